"""The host-side pad and cut of bucketed calls (``runtime/host_copies.py``): the same values as torch's own
ops, in every dtype, without torch's intra-op threads."""

import pytest
import torch

from tpucompile.runtime import host_copies

_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int64,
           torch.int32, torch.uint8, torch.uint16, torch.bool, torch.complex64]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` compared bit for bit (NaN payloads and float8 included)."""
    if t.dtype.is_complex:
        return torch.view_as_real(t).view(torch.int32)
    if t.dtype.is_floating_point:
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype is torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    return (torch.randn(shape) * 50).to(dtype)


@pytest.mark.parametrize("width", [5, 5000], ids=["torch-sized", "numpy-sized"])
@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_pad_and_cut_match_torch(dtype, width, seeded):
    x = _sample(dtype, (2, 7, width))
    padded = host_copies.pad(x, (2, 16, width + 3))
    as_bytes = dtype.itemsize == 1 and dtype.is_floating_point  # torch pads no float8
    expected = torch.nn.functional.pad(x.view(torch.uint8) if as_bytes else x, (0, 3, 0, 9)).view(dtype)
    assert padded.dtype == dtype and padded.shape == (2, 16, width + 3)
    assert torch.equal(_bits(padded), _bits(expected))
    cut = host_copies.cut(padded, (2, 7, width))
    assert cut.dtype == dtype and cut.is_contiguous() and torch.equal(_bits(cut), _bits(x))
    assert host_copies.pad(x, (2, 7, width)) is x  # already its bucket's shape
    assert (x.numel() >= host_copies.SERIAL_ELEMENTS) == (width == 5000)


@pytest.mark.parametrize("width", [6, 6000], ids=["torch-sized", "numpy-sized"])
def test_pad_cuts_what_another_bucket_padded_and_takes_views(width, seeded):
    x = torch.randn(4, 32, width)
    assert torch.equal(host_copies.pad(x, (4, 16, width)), x[:, :16])
    view = torch.randn(width, 10).t()[:, 1:4]  # a strided view
    assert torch.equal(host_copies.pad(view, (16, 3)), torch.nn.functional.pad(view, (0, 0, 0, 6)))
    assert torch.equal(host_copies.cut(view, (5, 2)), view[:5, :2])
    grad = torch.randn(3, width, requires_grad=True)
    assert torch.equal(host_copies.pad(grad, (5, width))[:3], grad.detach())


def test_meta_tensors_of_compile_only_runs():
    x = torch.empty(3, 4, device="meta")
    assert host_copies.pad(x, (8, 4)).shape == (8, 4)
    assert host_copies.cut(torch.empty(8, 4, device="meta"), (3, 4)).shape == (3, 4)
