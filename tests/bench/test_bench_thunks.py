"""``bench/thunks.py`` sorts XLA's thunks by the work their HLO does: check it reads XLA's own text right."""

from __future__ import annotations

import importlib.util
import pathlib

import torch
import torch.nn.functional as F

from tpucompile import driver
from tpucompile.runtime.compiler import optimized_hlo

_PATH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "thunks.py"
_spec = importlib.util.spec_from_file_location("bench_thunks", _PATH)
thunks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(thunks)

_HLO = """HloModule main, entry_computation_layout={(f32[8,4,6,6]{3,2,1,0})->f32[8,4,6,6]{3,2,1,0}}

%fused_transpose (param_0: f32[8,4,6,6]) -> f32[8,6,6,4] {
  %param_0 = f32[8,4,6,6]{3,2,1,0} parameter(0)
  ROOT %transpose.1 = f32[8,6,6,4]{3,2,1,0} transpose(%param_0), dimensions={0,2,3,1}
}

%fused_sum (param_0.1: f32[8,4,6,6]) -> f32[4] {
  %param_0.1 = f32[8,4,6,6]{3,2,1,0} parameter(0)
  %constant.1 = f32[] constant(0)
  ROOT %reduce.1 = f32[4]{0} reduce(%param_0.1, %constant.1), dimensions={0,2,3}, to_apply=%add
}

%fused_relu_grad (param_0.2: f32[8,4,6,6], param_1.2: f32[8,4,6,6]) -> f32[8,4,6,6] {
  %param_0.2 = f32[8,4,6,6]{3,2,1,0} parameter(0)
  %param_1.2 = f32[8,4,6,6]{3,2,1,0} parameter(1)
  %constant.2 = f32[] constant(0)
  %broadcast.2 = f32[8,4,6,6]{3,2,1,0} broadcast(%constant.2), dimensions={}
  %compare.2 = pred[8,4,6,6]{3,2,1,0} compare(%param_0.2, %broadcast.2), direction=GT
  ROOT %select.2 = f32[8,4,6,6]{3,2,1,0} select(%compare.2, %param_1.2, %broadcast.2)
}

%fused_scale (param_0.3: f32[8,4,6,6]) -> f32[8,4,6,6] {
  %param_0.3 = f32[8,4,6,6]{3,2,1,0} parameter(0)
  ROOT %multiply.3 = f32[8,4,6,6]{3,2,1,0} multiply(%param_0.3, %param_0.3)
}

ENTRY %main.1 (Arg_0.1: f32[8,4,6,6]) -> f32[8,4,6,6] {
  %Arg_0.1 = f32[8,4,6,6]{3,2,1,0} parameter(0)
  %transpose_fusion = f32[8,6,6,4]{3,2,1,0} fusion(%Arg_0.1), kind=kLoop, calls=%fused_transpose
  %convolution.1 = f32[8,6,6,4]{3,2,1,0} convolution(%transpose_fusion, %transpose_fusion), window={size=1x1}
  %sum_fusion = f32[4]{0} fusion(%Arg_0.1), kind=kLoop, calls=%fused_sum
  %gemm = f32[1,8,8]{2,1,0} custom-call(%Arg_0.1), custom_call_target="tpucompile_host_gemm"
  %relu_fusion = f32[8,4,6,6]{3,2,1,0} fusion(%Arg_0.1, %Arg_0.1), kind=kLoop, calls=%fused_relu_grad
  ROOT %scale_fusion = f32[8,4,6,6]{3,2,1,0} fusion(%relu_fusion), kind=kLoop, calls=%fused_scale
}
"""


def test_each_kind_of_work_is_told_apart():
    kinds = thunks.classify(_HLO)
    assert kinds == {
        "Arg_0.1": "elementwise, other",
        "transpose_fusion": "transpose or copy",
        "convolution.1": "convolution",
        "sum_fusion": "reduction",
        "gemm": "matrix product",
        "relu_fusion": "select (pooling, ReLU gradient)",
        "scale_fusion": "elementwise, other",
    }


def test_a_compiled_convolution_step_is_classified():
    """XLA's optimised HLO of a real conv + BatchNorm + ReLU training step: its convolutions and reductions are
    found among the entry computation's instructions."""
    hlo = []
    remove = driver.add_observer(lambda event: hlo.append(optimized_hlo(event.executable)))
    try:
        torch.manual_seed(0)
        conv, norm = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)

        def step(x):
            return F.relu(norm(conv(x))).sum()

        torch.compile(step, backend="tpucompile")(torch.randn(2, 3, 8, 8)).backward()
    finally:
        remove()
    assert len(hlo) == 2
    forward, backward = (set(thunks.classify(text).values()) for text in hlo)
    assert {"convolution", "reduction"} <= forward
    assert {"convolution", "reduction"} <= backward


def test_an_asynchronous_thunk_lasts_until_its_end_event():
    """XLA writes an ``end:`` event for every thunk: right after it returns, or, for one that completes
    asynchronously, when its work is done."""
    events = [
        (0, 10, "convolution.1"),  # returns at 10, completes on the pool at 50
        (12, 20, "fusion.2"),
        (20, 21, "end: fusion.2"),
        (50, 51, "end: convolution.1"),
        (60, 70, "convolution.1"),  # the same thunk in the next execution, done when it returns
        (70, 71, "end: convolution.1"),
    ]
    assert thunks._thunk_times(events) == [("convolution.1", 0.05), ("fusion.2", 0.008), ("convolution.1", 0.01)]
