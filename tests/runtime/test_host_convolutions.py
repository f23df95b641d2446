"""Convolutions through the host im2col/col2im + BLAS kernel: which convolutions the CPU rewrite takes, that
every form the lowering emits (forward, input gradient, kernel gradient, transposed) computes what PyTorch
does, values and gradients, and that a call the kernel cannot serve fails with a message naming it."""

from __future__ import annotations

import copy
import textwrap

import pytest
import torch
import torch.nn as nn

from tests.fresh_process import run_json
from tpucompile import driver
from tpucompile.runtime import compile_module, optimized_hlo
from tpucompile.runtime.host_kernels.library import CONV_TARGET_NAME, kernels
from tpucompile.runtime.transfer import to_buffer, to_tensor

# (name, module, input shape, kernel calls in forward + backward programs)
CASES = [
    ("3x3 same padding, batch 5 (partial sums over workers)", lambda: nn.Conv2d(4, 6, 3, padding=1), (5, 4, 16, 16), 3),
    ("3x3 stride 2 (input gradient by col2im)", lambda: nn.Conv2d(3, 8, 3, stride=2, padding=1), (2, 3, 32, 32), 3),
    ("1x1 stride 2 shortcut", lambda: nn.Conv2d(8, 16, 1, stride=2, bias=False), (3, 8, 32, 32), 3),
    ("5x5 unpadded, batch 1", lambda: nn.Conv2d(3, 5, 5), (1, 3, 20, 20), 3),
    ("uneven kernel, stride, padding and dilation",
     lambda: nn.Conv2d(3, 5, (3, 2), stride=(1, 2), padding=(2, 1), dilation=(2, 1)), (2, 3, 18, 35), 3),
    ("transposed 2x2 stride 2", lambda: nn.ConvTranspose2d(6, 4, 2, stride=2), (2, 6, 16, 16), 3),
    ("transposed with output padding", lambda: nn.ConvTranspose2d(5, 3, 3, stride=2, padding=1, output_padding=1),
     (2, 5, 16, 16), 3),
    ("transposed whose padding crops", lambda: nn.ConvTranspose2d(4, 3, 1, stride=2, padding=1), (2, 4, 17, 17), 3),
    ("small images: input gradient only, images grouped 4 + 1", lambda: nn.Conv2d(8, 16, 3, stride=2, padding=1),
     (5, 8, 16, 16), 1),
    ("small images stay with XLA", lambda: nn.Conv2d(4, 6, 3, padding=1), (2, 4, 8, 8), 0),
    ("grouped stays with XLA", lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2), (2, 4, 16, 16), 0),
    ("float64 stays with XLA", lambda: nn.Conv2d(4, 6, 3, padding=1).double(), (2, 4, 16, 16), 0),
]


@pytest.mark.parametrize("name, make, shape, calls", CASES, ids=[case[0] for case in CASES])
def test_convolutions_and_gradients_match_pytorch(target, name, make, shape, calls):
    torch.manual_seed(0)
    eager = make()
    dtype = eager.weight.dtype
    model = copy.deepcopy(eager)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    programs: list[str] = []
    remove = driver.add_observer(lambda event: programs.append(optimized_hlo(event.executable)))
    try:
        torch._dynamo.reset()
        y = torch.compile(model, backend="tpucompile", options={"host_kernels": "on"})(x)
        gy = torch.randn_like(y)
        y.backward(gy)
    finally:
        remove()
        torch._dynamo.reset()
    assert sum(hlo.count(f'custom_call_target="{CONV_TARGET_NAME}"') for hlo in programs) == calls, programs

    # The reference in float64: differences then measure our rounding, not eager's.
    reference = copy.deepcopy(eager).double()
    x64 = x.detach().double().requires_grad_()
    y64 = reference(x64)
    y64.backward(gy.double())
    pairs = [("output", y, y64), ("input gradient", x.grad, x64.grad)]
    pairs += [(f"{n} gradient", p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), reference.parameters(),
                                                                      strict=True)]
    for what, got, want in pairs:
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6 * scale, msg=f"{name}: {what}")


def _call(attributes: str, lhs: str, rhs: str, out: str, scratch: int) -> str:
    return textwrap.dedent(f"""
        func.func @main(%a: tensor<{lhs}xf32>, %b: tensor<{rhs}xf32>) -> tensor<{out}xf32> {{
          %0:2 = stablehlo.custom_call @{CONV_TARGET_NAME}(%a, %b) {{api_version = 1 : i32, backend_config = "",
              mhlo.backend_config = {{{attributes}}}}}
              : (tensor<{lhs}xf32>, tensor<{rhs}xf32>) -> (tensor<{out}xf32>, tensor<{scratch}xf32>)
          return %0#0 : tensor<{out}xf32>
        }}""")


def _attributes(**overrides: int) -> str:
    values = dict(mode=0, kernel_io=0, group=1, stride_h=1, stride_w=1, pad_h=1, pad_w=1, lhs_dilation_h=1,
                  lhs_dilation_w=1, rhs_dilation_h=1, rhs_dilation_w=1)
    values.update(overrides)
    return ", ".join(f"{name} = {value} : i64" for name, value in sorted(values.items()) if value is not None)


@pytest.mark.parametrize("attributes, scratch, message", [
    (_attributes(mode=None), 2 * 9 * 16, "bad attributes"),
    (_attributes(mode=3), 2 * 9 * 16, "bad attributes"),
    (_attributes(stride_h=0), 2 * 9 * 16, "bad attributes"),
    (_attributes(), 10, "scratch too small"),
], ids=["no mode", "unknown mode", "zero stride", "scratch too small"])
def test_the_kernel_refuses_a_call_it_cannot_serve(target, attributes, scratch, message):
    """Refused calls fail with XLA's error naming the kernel and why; the kernel never reads or writes memory it
    was not given."""
    loaded = compile_module(_call(attributes, "1x2x4x4", "3x2x3x3", "1x3x4x4", scratch), target)
    arrays = [torch.ones(1, 2, 4, 4), torch.ones(3, 2, 3, 3)]
    with pytest.raises(Exception, match=f"{CONV_TARGET_NAME}: {message}"):
        to_tensor(loaded.execute([to_buffer(a, target.device) for a in arrays])[0])


def test_a_well_formed_call_computes_the_convolution(target):
    """The same hand-written call with valid attributes: the check above refuses for the stated reason only."""
    scratch = 2 * 9 * 16 + 3 * 16  # columns + staging, one worker
    loaded = compile_module(_call(_attributes(), "1x2x4x4", "3x2x3x3", "1x3x4x4", scratch), target)
    x, w = torch.randn(1, 2, 4, 4), torch.randn(3, 2, 3, 3)
    got = to_tensor(loaded.execute([to_buffer(x, target.device), to_buffer(w, target.device)])[0])
    torch.testing.assert_close(got, torch.nn.functional.conv2d(x, w, padding=1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", [0, 1], ids=["forward", "kernel gradient"])
def test_grouped_images_compute_what_one_at_a_time_does(target, mode):
    """Images stacked into one product (``group`` 2 over a batch of 3: a group of 2, then 1) in the modes that
    the rewrite sends only images large enough for groups of one: the kernel must still be right there."""
    x, w, gy = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 3, 3), torch.randn(3, 3, 4, 4)
    # Per worker: columns (2*9 rows x 2*16 positions), staging (3 x 32), in mode 1 a partial sum (3 x 18).
    slot = 18 * 32 + 3 * 32 + (3 * 18 if mode == 1 else 0)
    if mode == 0:
        module, operands = _call(_attributes(group=2), "3x2x4x4", "3x2x3x3", "3x3x4x4", 2 * slot), (x, w)
        want = torch.nn.functional.conv2d(x, w, padding=1)
    else:
        module, operands = _call(_attributes(mode=1, group=2), "3x2x4x4", "3x3x4x4", "3x2x3x3", 2 * slot), (x, gy)
        want = torch.nn.grad.conv2d_weight(x, w.shape, gy, padding=1)
    loaded = compile_module(module, target)
    got = to_tensor(loaded.execute([to_buffer(a, target.device) for a in operands])[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_turning_the_convolutions_off_changes_the_executable_key_not_the_results(tmp_path):
    """``TPUCOMPILE_HOST_CONV=0`` compiles XLA's own convolutions, under other cache keys, same results."""
    script = textwrap.dedent("""
        import json, torch
        from tpucompile import artifacts
        from tpucompile.runtime import get_target
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        out = torch.compile(conv, backend="tpucompile", options={"host_kernels": "on"})(torch.randn(2, 3, 16, 16))
        print(json.dumps({"host_blas": artifacts.environment(get_target())["host_blas"],
                          "out": out.flatten().tolist()}))
    """)
    on, off = (run_json(script, {"TPUCOMPILE_HOST_CONV": value, "TPUCOMPILE_CACHE_DIR": str(tmp_path / "cache")})
               for value in ("1", "0"))
    assert on["host_blas"] != off["host_blas"] and None not in (on["host_blas"], off["host_blas"])
    assert kernels().convolutions
    torch.testing.assert_close(torch.tensor(on["out"]), torch.tensor(off["out"]), rtol=1e-5, atol=1e-5)
