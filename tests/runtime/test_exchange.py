"""Tensors in and out of compiled programs: layouts, dtypes, reuse of device buffers."""

from __future__ import annotations

import pytest
import torch
from support import assert_compiles_like_eager, compile_fn

from tpucompile import driver
from tpucompile.runtime import get_target
from tpucompile.runtime.transfer import to_buffer, to_tensor


def test_non_contiguous_inputs_are_read_with_their_strides():
    w = torch.randn(4, 3)
    assert_compiles_like_eager(lambda a, b: a @ b, torch.randn(2, 4), w.t().t())
    assert_compiles_like_eager(lambda a, b: a + b, torch.randn(3, 4), w.t())
    assert_compiles_like_eager(lambda a: a * 2, torch.randn(6, 8)[::2, 1::3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64,
                                   torch.bool, torch.uint8, torch.int8, torch.float64])
def test_round_trip_keeps_values_and_dtype(dtype):
    device = get_target().device
    source = (torch.randn(3, 5) * 10).to(dtype)
    back = to_tensor(to_buffer(source, device))
    assert back.dtype == dtype and back.shape == source.shape
    assert torch.equal(back, source)


def test_zero_size_and_scalar_tensors():
    assert_compiles_like_eager(lambda a, b: (a * 2, b + 1), torch.randn(0, 3), torch.tensor(2.5))


def test_in_place_change_of_an_input_is_seen_by_the_next_call():
    f = compile_fn(lambda w, x: x @ w)
    w, x = torch.randn(3, 3), torch.randn(2, 3)
    torch.testing.assert_close(f(w, x), x @ w)
    with torch.no_grad():
        w.mul_(3)  # same tensor object and storage, new version: its device buffer must be refreshed
    torch.testing.assert_close(f(w, x), x @ w)
    w.data = torch.randn(3, 3)  # new storage behind the same tensor object
    torch.testing.assert_close(f(w, x), x @ w)


def test_outputs_do_not_alias_inputs():
    f = compile_fn(lambda x: (x + 0, x.clone()))
    x = torch.randn(4)
    a, b = f(x)
    a.add_(1)
    b.add_(1)
    torch.testing.assert_close(x + 1, a)
    torch.testing.assert_close(x + 1, b)


def test_unchanged_inputs_reuse_their_device_buffers():
    f = compile_fn(lambda w, x: x @ w)
    w, x = torch.randn(3, 3), torch.randn(2, 3)
    f(w, x)
    executable = driver.recent_executables()[-1]
    first = executable.buffers([w, x])
    second = executable.buffers([w, torch.randn(2, 3)])
    assert first[0] is second[0]
    assert first[1] is not second[1]
