"""3-D vision layers trained through ``torch.compile``: each op of an R3D-style video network (Conv3d,
BatchNorm3d, pools) forward and backward on its own, then a reduced R3D and a ConvTranspose3d decoder
trained one step, against eager PyTorch.

Float32 results are compared to 1e-5 of the largest magnitude of each tensor (of all parameter gradients
for a whole network): a product or reduction rounds each term, so the error of an element scales with its
operands, not with its own (possibly cancelled) size. Observed differences are under 1e-6 of that scale.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.support import compile_fn
from tpucompile import driver

aten = torch.ops.aten

SCALED_TOLERANCE = 1e-5


def _assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, scale: float | None = None,
                         what: str = "") -> None:
    """Equal within ``SCALED_TOLERANCE`` of ``scale`` (default: the largest magnitude of ``expected``)."""
    assert actual is not None, f"{what}: no value"
    scale = expected.abs().max().item() if scale is None else scale
    torch.testing.assert_close(actual, expected, atol=SCALED_TOLERANCE * scale, rtol=0,
                               msg=lambda message: f"{what}: {message}")


def _check_op(fn: Callable, *inputs: torch.Tensor) -> None:
    """``fn`` compiled (nothing may run eagerly) against eager: its output, and the gradient of every float
    input for one fixed random cotangent."""
    eager_inputs = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    compiled_inputs = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    expected = fn(*eager_inputs)
    before = driver.graphs_compiled()
    actual = compile_fn(fn, fallback="error")(*compiled_inputs)
    assert driver.graphs_compiled() > before, "tpucompile compiled no graph"
    _assert_close_scaled(actual, expected, what="output")
    cotangent = torch.randn(expected.shape)
    expected.backward(cotangent)
    actual.backward(cotangent)
    for index, (a, e) in enumerate(zip(compiled_inputs, eager_inputs, strict=True)):
        if e.requires_grad:
            _assert_close_scaled(a.grad, e.grad, what=f"gradient of input {index}")


# ----------------------------------------------------------------------------------------------------------
# Single ops

# (stride, padding, dilation, groups, kernel, bias)
CONV3D = {
    "simple_3x3x3": (1, 1, 1, 1, 3, True),
    "simple_3x3x3_stride2": (2, 1, 1, 1, 3, False),
    "r3d_stem": ((1, 2, 2), (1, 3, 3), 1, 1, (3, 7, 7), False),
    "downsample_1x1x1_stride2": (2, 0, 1, 1, 1, False),
    "asymmetric_stride_padding": ((2, 1, 3), (0, 1, 2), 1, 1, (2, 3, 3), True),
    "dilation": ((1, 2, 1), 1, (2, 1, 3), 1, (3, 2, 2), True),
    "groups_dilation": ((2, 1, 1), (1, 0, 1), (1, 2, 1), 4, (3, 1, 2), False),
    "stride_beyond_kernel": (3, 2, 1, 2, (2, 3, 4), True),
    "r2plus1d_temporal": ((2, 1, 1), (1, 0, 0), 1, 1, (3, 1, 1), False),
}


@pytest.mark.parametrize("case", CONV3D)
def test_conv3d_forward_backward(aten_ops, seeded, case):
    stride, padding, dilation, groups, kernel, bias = CONV3D[case]
    kernel = (kernel,) * 3 if isinstance(kernel, int) else kernel
    x, w = torch.randn(2, 4, 5, 9, 11), torch.randn(8, 4 // groups, *kernel)

    def conv(x, w, *b):
        return F.conv3d(x, w, b[0] if b else None, stride, padding, dilation, groups)

    _check_op(conv, x, w, *([torch.randn(8)] if bias else []))
    assert {aten.convolution.default, aten.convolution_backward.default} <= aten_ops


# (stride, padding, output_padding, dilation, groups, kernel)
CONV_TRANSPOSE3D = {
    "upsample_stride2": (2, 1, 1, 1, 1, 3),
    "asymmetric_groups": ((1, 2, 2), (1, 0, 1), (0, 1, 0), 1, 2, (3, 2, 3)),
    "asymmetric_dilation": ((2, 3, 1), 0, (1, 2, 0), (1, 1, 2), 1, (2, 2, 3)),
    "groups_dilation": (1, 1, 0, 2, 4, 3),
}


@pytest.mark.parametrize("case", CONV_TRANSPOSE3D)
def test_conv_transpose3d_forward_backward(aten_ops, seeded, case):
    stride, padding, output_padding, dilation, groups, kernel = CONV_TRANSPOSE3D[case]
    kernel = (kernel,) * 3 if isinstance(kernel, int) else kernel
    x, w, b = torch.randn(2, 4, 3, 4, 5), torch.randn(4, 8 // groups, *kernel), torch.randn(8)
    _check_op(lambda x, w, b: F.conv_transpose3d(x, w, b, stride, padding, output_padding, groups, dilation),
              x, w, b)
    assert aten.convolution_backward.default in aten_ops


POOLS = {
    "adaptive_avg_to_1": lambda x: F.adaptive_avg_pool3d(x, 1),
    "adaptive_avg_overlapping": lambda x: F.adaptive_avg_pool3d(x, (3, 4, 5)),
    "adaptive_max": lambda x: F.adaptive_max_pool3d(x, (2, 3, 4)),
    "max": lambda x: F.max_pool3d(x, 3, 2, 1),
    "max_r2plus1d": lambda x: F.max_pool3d(x, (1, 3, 3), (1, 2, 2), (0, 1, 1)),
    "max_dilation_ceil": lambda x: F.max_pool3d(x, (2, 3, 2), (2, 1, 3), (1, 1, 0), (1, 2, 1), ceil_mode=True),
    "avg": lambda x: F.avg_pool3d(x, 3, 2, 1),
    "avg_exclude_padding_ceil": lambda x: F.avg_pool3d(x, (1, 3, 2), (1, 2, 1), (0, 1, 1), ceil_mode=True,
                                                       count_include_pad=False),
    "avg_divisor": lambda x: F.avg_pool3d(x, (2, 3, 2), (2, 1, 3), (1, 1, 0), divisor_override=5),
}


@pytest.mark.parametrize("case", POOLS)
def test_pool3d_forward_backward(seeded, case):
    x = torch.randn(2, 4, 5, 6, 7)
    if case.startswith(("max", "adaptive_max")):
        x = torch.randint(0, 3, x.shape).float()  # ties, as after a ReLU: the first maximum takes the gradient
    _check_op(POOLS[case], x)


# ----------------------------------------------------------------------------------------------------------
# Modules and networks, one training step


def _check_module_step(eager: nn.Module, compiled: nn.Module, run_compiled: Callable, x: torch.Tensor) -> None:
    """One forward and backward of ``eager`` and of ``compiled`` (called through ``run_compiled``) on ``x``:
    equal outputs, input gradients and parameter gradients (to the scale of the largest parameter
    gradient)."""
    x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = eager(x_eager)
    actual = run_compiled(x_compiled)
    _assert_close_scaled(actual, expected, what="output")
    weights = torch.linspace(-1.0, 2.0, expected.numel()).reshape(expected.shape)
    (expected * weights).square().mean().backward()
    (actual * weights).square().mean().backward()
    _assert_close_scaled(x_compiled.grad, x_eager.grad, what="input gradient")
    grads = [(name, p.grad, e.grad) for (name, p), e in
             zip(compiled.named_parameters(), eager.parameters(), strict=True)]
    scale = max(e.abs().max().item() for _, _, e in grads)
    for name, got, want in grads:
        _assert_close_scaled(got, want, scale, what=f"gradient of {name}")


def _assert_buffers_equal(compiled: nn.Module, eager: nn.Module) -> None:
    """Running statistics to float32 rounding of their own size; counters exactly."""
    for (name, got), want in zip(compiled.named_buffers(), eager.buffers(), strict=True):
        if want.is_floating_point():
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        else:
            assert torch.equal(got, want), name


@pytest.mark.parametrize("shape", [(2, 4, 3, 5, 6), (1, 4, 1, 2, 2)])
def test_batch_norm3d_training(seeded, shape):
    """Output, input/weight/bias gradients and the running statistics; inputs off zero mean, as activations
    are."""
    eager = nn.BatchNorm3d(shape[1])
    with torch.no_grad():
        eager.weight.uniform_(0.5, 1.5)
        eager.bias.normal_()
    compiled = nn.BatchNorm3d(shape[1])
    compiled.load_state_dict(eager.state_dict())
    before = driver.graphs_compiled()
    _check_module_step(eager, compiled, compile_fn(compiled, fallback="error"), torch.randn(shape) * 2 + 1)
    assert driver.graphs_compiled() > before, "tpucompile compiled no graph"
    _assert_buffers_equal(compiled, eager)


def _conv_bn(cin: int, cout: int, kernel: Any, stride: Any = 1, padding: Any = 0, relu: bool = True
             ) -> nn.Sequential:
    layers = [nn.Conv3d(cin, cout, kernel, stride, padding, bias=False), nn.BatchNorm3d(cout)]
    return nn.Sequential(*layers, *([nn.ReLU(inplace=True)] if relu else []))


class BasicBlock(nn.Module):
    """torchvision's video ``BasicBlock`` with ``Conv3DSimple``: two 3x3x3 convolutions, and a strided 1x1x1
    convolution on the shortcut where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = _conv_bn(cin, cout, 3, stride, 1)
        self.conv2 = _conv_bn(cout, cout, 3, 1, 1, relu=False)
        self.downsample = _conv_bn(cin, cout, 1, stride, relu=False) if stride != 1 or cin != cout else None
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x if self.downsample is None else self.downsample(x)
        out = self.conv2(self.conv1(x))
        out += residual
        return self.relu(out)


class ReducedR3D(nn.Module):
    """R3D-18's structure (stem, residual stages, global average pool, classifier) with two narrow stages."""

    def __init__(self, widths: Sequence[int] = (8, 16), classes: int = 10) -> None:
        super().__init__()
        self.stem = _conv_bn(3, widths[0], (3, 7, 7), (1, 2, 2), (1, 3, 3))
        stages, cin = [], widths[0]
        for index, width in enumerate(widths):
            stages.append(nn.Sequential(BasicBlock(cin, width, 1 if index == 0 else 2), BasicBlock(width, width, 1)))
            cin = width
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.fc = nn.Linear(cin, classes)
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv3d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.stages(self.stem(x))).flatten(1))


class VideoDecoder(nn.Module):
    """Conv3d encoder and ConvTranspose3d decoder with BatchNorm3d, as in video segmentation or generation."""

    def __init__(self) -> None:
        super().__init__()
        self.down = _conv_bn(3, 8, 3, (1, 2, 2), 1)
        self.up = nn.Sequential(nn.ConvTranspose3d(8, 6, (3, 4, 4), (1, 2, 2), 1, bias=False), nn.BatchNorm3d(6),
                                nn.ReLU(inplace=True), nn.ConvTranspose3d(6, 2, 3, (2, 1, 1), 1, (1, 0, 0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


NETWORKS = {
    "reduced_r3d": (ReducedR3D, (2, 3, 4, 32, 32)),
    "conv_transpose3d_decoder": (VideoDecoder, (2, 3, 4, 12, 12)),
}


@pytest.mark.parametrize("network", NETWORKS)
def test_video_network_training_step(network):
    """Two SGD steps: every gradient of each, and the running statistics after them."""
    make, shape = NETWORKS[network]
    torch.manual_seed(0)
    eager = make()
    compiled = make()
    compiled.load_state_dict(eager.state_dict())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, compiled)]
    before = driver.graphs_compiled()
    run_compiled = compile_fn(compiled, fallback="error")
    for _ in range(2):
        for optimizer in optimizers:
            optimizer.zero_grad()
        _check_module_step(eager, compiled, run_compiled, torch.randn(shape))
        for optimizer in optimizers:
            optimizer.step()
    assert driver.graphs_compiled() > before, "tpucompile compiled no graph"
    _assert_buffers_equal(compiled, eager)
