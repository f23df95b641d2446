"""The ``torch.fft`` family on ``stablehlo.fft``: every function with its ``n``/``s``/``dim``/``norm``
arguments against eager, transforms over more dimensions than one ``stablehlo.fft`` takes, shifts, short-time
transforms with windows, gradients, and the graphs compiled for a TPU target."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from tests.support import assert_compiles_like_eager, compile_fn
from tpucompile.errors import TpuCompileWarning

FFT_OPS = {torch.ops.aten._fft_c2c.default, torch.ops.aten._fft_r2c.default, torch.ops.aten._fft_c2r.default}
NORMS = [None, "forward", "ortho"]
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason='libtpu is not installed (pip install "tpucompile[tpu]")')


def _real(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _complex(*shape, seed=0, dtype=torch.complex64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# Sums over up to 64 terms of unit-variance values: float32 rounding grows with the length.
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


@pytest.mark.parametrize("norm", NORMS, ids=str)
def test_one_dimensional_transforms_with_lengths_and_dims(norm, aten_ops):
    z, x = _complex(4, 6, 10), _real(4, 6, 10)
    functions = lambda z, x: (  # noqa: E731
        torch.fft.fft(z, norm=norm), torch.fft.ifft(z, n=7, dim=1, norm=norm),
        torch.fft.fft(x, n=16, dim=0, norm=norm), torch.fft.rfft(x, norm=norm),
        torch.fft.rfft(x, n=7, dim=1, norm=norm), torch.fft.irfft(z, norm=norm),
        torch.fft.irfft(z, n=9, dim=1, norm=norm), torch.fft.hfft(z, norm=norm),
        torch.fft.hfft(z, n=5, dim=0, norm=norm), torch.fft.ihfft(x, norm=norm),
        torch.fft.ihfft(x, n=12, dim=-2, norm=norm))
    assert_compiles_like_eager(functions, z, x, **TOLERANCE)
    assert aten_ops >= FFT_OPS


@pytest.mark.parametrize("norm", NORMS, ids=str)
def test_two_and_n_dimensional_transforms(norm):
    z, x = _complex(3, 6, 8, 5), _real(3, 6, 8, 5)
    functions = lambda z, x: (  # noqa: E731
        torch.fft.fft2(z, norm=norm), torch.fft.ifft2(z, s=(4, 9), dim=(0, 2), norm=norm),
        torch.fft.rfft2(x, norm=norm), torch.fft.irfft2(z, s=(5, 6), norm=norm), torch.fft.hfft2(z, norm=norm),
        torch.fft.ihfft2(x, norm=norm), torch.fft.fftn(z, dim=(2, 0), norm=norm), torch.fft.ifftn(z, norm=norm),
        torch.fft.rfftn(x, dim=(1, 3), norm=norm), torch.fft.irfftn(z, s=(3, 6, 8), norm=norm),
        torch.fft.hfftn(z, dim=(1, 2), norm=norm), torch.fft.ihfftn(x, s=(4, 4), dim=(0, 3), norm=norm))
    assert_compiles_like_eager(functions, z, x, **TOLERANCE)


@pytest.mark.parametrize("norm", NORMS, ids=str)
def test_transforms_over_more_dimensions_than_one_stablehlo_fft_takes(norm):
    """Four and five transformed dimensions: ``stablehlo.fft`` takes three, so these run as several passes."""
    z, x = _complex(3, 4, 2, 5, 6), _real(3, 4, 2, 5, 6)
    functions = lambda z, x: (  # noqa: E731
        torch.fft.fftn(z, norm=norm), torch.fft.ifftn(z, dim=(0, 1, 3, 4), norm=norm), torch.fft.rfftn(x, norm=norm),
        torch.fft.rfftn(x, dim=(4, 0, 2, 1), norm=norm), torch.fft.irfftn(z, norm=norm),
        torch.fft.irfftn(z, s=(3, 4, 4, 10), dim=(0, 1, 2, 4), norm=norm), torch.fft.hfftn(z, norm=norm))
    assert_compiles_like_eager(functions, z, x, **TOLERANCE)


def test_double_precision_transforms():
    z, x = _complex(4, 8, dtype=torch.complex128), _real(4, 8, dtype=torch.float64)
    assert_compiles_like_eager(lambda z, x: (torch.fft.fft2(z), torch.fft.rfft(x), torch.fft.irfft(z, n=8)),
                               z, x, atol=1e-10, rtol=1e-10)


def test_shifts_and_frequencies():
    z = _complex(5, 6)
    assert_compiles_like_eager(
        lambda z: (torch.fft.fftshift(z), torch.fft.ifftshift(z, dim=0),
                   torch.fft.fftshift(torch.fft.fft(z), dim=(0, 1)), torch.fft.fftfreq(7) * z.real.sum(),
                   torch.fft.rfftfreq(8, d=0.5) + z.imag.mean()), z)


@pytest.mark.parametrize("center", [True, False], ids=["centered", "uncentered"])
def test_short_time_transforms_with_windows(center):
    signal = _real(2, 400)
    window = torch.hann_window(64)

    def spectrum(signal, window):
        return torch.stft(signal, n_fft=64, hop_length=16, window=window, center=center, return_complex=True)

    def roundtrip(signal, window):
        return torch.istft(spectrum(signal, window), n_fft=64, hop_length=16, window=window, center=center,
                           length=signal.shape[-1])

    # istft needs a window whose overlapping squares never vanish: only the centred frames cover the ends
    assert_compiles_like_eager(roundtrip if center else spectrum, signal, window, **TOLERANCE)
    assert_compiles_like_eager(lambda s: torch.stft(s, n_fft=32, return_complex=True, onesided=False,
                                                    normalized=True), signal, **TOLERANCE)


def test_gradients_of_real_losses_through_transforms():
    """A real loss of FFTs of a real and a complex input: gradients in PyTorch's convention."""

    def loss(x, z):
        spectrum = torch.fft.rfft2(x) * torch.fft.fft2(z)[..., : x.shape[-1] // 2 + 1]
        return (torch.fft.irfft2(spectrum, s=x.shape[-2:]).sin(), torch.fft.ihfft(x).abs(),
                torch.fft.hfft(z, n=6, norm="ortho"), torch.fft.fftn(z, dim=(0, 1, 2, 3)).angle())

    assert_compiles_like_eager(loss, _real(2, 3, 4, 8), _complex(2, 3, 4, 8), grad=True, **TOLERANCE)


def test_an_fnet_block_trains():
    """FNet's token mixing: the real part of a 2-D FFT over (sequence, hidden), then a feed-forward layer."""
    torch.manual_seed(0)
    norm, dense = torch.nn.LayerNorm(32), torch.nn.Linear(32, 32)

    def block(x):
        mixed = norm(x + torch.fft.fft2(x.to(torch.complex64)).real)
        return norm(mixed + dense(torch.nn.functional.gelu(mixed)))

    assert_compiles_like_eager(block, _real(2, 16, 32), grad=True, **TOLERANCE)


@needs_libtpu
def test_fourier_graphs_compile_for_a_tpu_target(tmp_path):
    """Compile-only for ``tpu:v5e:1x1``: complex64 transforms and their gradients compile; complex128, which a
    TPU does not have, is refused by name."""
    options = {"targets": ["tpu:v5e:1x1"], "cache_dir": str(tmp_path), "fallback": "error"}
    x = torch.randn(2, 4, 16, 32, device="meta", requires_grad=True)

    def mix(x):
        return (torch.fft.irfft(torch.fft.rfft(x) * torch.fft.fft(x.to(torch.complex64))[..., :17], n=32)
                + torch.fft.fftn(x.to(torch.complex64)).abs())

    with warnings.catch_warnings():
        warnings.simplefilter("error", TpuCompileWarning)  # a refusal by the target's compiler fails the test
        out = torch.compile(mix, backend="tpucompile", options=options)(x)
        assert out.is_meta and out.shape == (2, 4, 16, 32)
        out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    torch._dynamo.reset()
    with pytest.warns(TpuCompileWarning, match=r"cannot be compiled for tpu:v5e:1x1: .*TPUs have no complex128"):
        torch.compile(lambda x: torch.fft.fft(x.to(torch.complex128)).abs() * 2, backend="tpucompile",
                      options=options)(torch.randn(4, 8, device="meta"))


def test_results_are_not_sent_back_to_eager():
    compiled = compile_fn(lambda x: torch.fft.irfft(torch.fft.rfft(x) * 2), fallback="error")
    x = _real(3, 10)
    torch.testing.assert_close(compiled(x), x * 2, **TOLERANCE)
