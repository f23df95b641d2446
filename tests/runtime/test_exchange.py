"""Tensors in and out of compiled programs: layouts, dtypes, reuse of device buffers."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from support import assert_compiles_like_eager, compile_fn

from tpucompile import driver
from tpucompile.runtime import executable as executable_module
from tpucompile.runtime import get_target
from tpucompile.runtime.resident import ResidentBuffers, resident_buffers
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
    w.data = w.data.t()  # same storage and sizes, other strides
    torch.testing.assert_close(f(w, x), x @ w)
    w.data = w.data.view(torch.int32).view(torch.float32)  # same storage, sizes and dtype: a new tensor impl
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


def test_a_training_step_imports_only_what_changed_out_of_place(monkeypatch):
    """Weights cross once for the whole run (their buffers share memory and see the optimiser's in-place
    updates); the backward gets the forward's saved activations back without importing them; only the
    loss gradient, made by eager code outside the graph, is imported each step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 4))
    eager = copy.deepcopy(model)
    compiled = compile_fn(model)
    x, labels = torch.randn(5, 8), torch.randint(0, 4, (5,))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, model)]
    imports = []
    real_to_buffer = executable_module.to_buffer
    monkeypatch.setattr(executable_module, "to_buffer", lambda t, d: imports.append(t) or real_to_buffer(t, d))
    for step in range(4):
        imports.clear()
        for net, optimizer in zip((eager, compiled), optimizers, strict=True):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(net(x), labels).backward()
            optimizer.step()
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
            torch.testing.assert_close(p, q)
        if step > 0:
            assert [tuple(t.shape) for t in imports] == [(5, 4)], [tuple(t.shape) for t in imports]


def test_outputs_fed_back_in_are_not_imported_again(monkeypatch):
    f = compile_fn(lambda a: a * 2 + 1)
    a = torch.randn(4, 4)
    b = f(a)
    imports = []
    real_to_buffer = executable_module.to_buffer
    monkeypatch.setattr(executable_module, "to_buffer", lambda t, d: imports.append(t) or real_to_buffer(t, d))
    c = f(b)
    torch.testing.assert_close(c, (a * 2 + 1) * 2 + 1)
    assert imports == []
    b.add_(1)  # seen through the shared memory
    torch.testing.assert_close(f(b), (a * 2 + 2) * 2 + 1)


def test_resident_entries_go_with_their_tensors():
    """An imported buffer holds its tensor (and so its Python object) alive: the table must not keep it."""
    device = get_target().device
    resident = resident_buffers(device)
    f = compile_fn(lambda a: a.sin())
    f(torch.randn(64))
    before = len(resident)
    inputs, outputs = [], []
    for _ in range(4):
        a = torch.randn(64)
        out = f(a)
        inputs.append(weakref.ref(a))
        outputs.append(weakref.ref(out))
        del a, out
    gc.collect()
    assert [r() is None for r in outputs] == [True] * 4
    assert [r() is None for r in inputs] == [True, True, True, False]  # the last is still the slot's
    assert len(resident) <= before + 1


def test_a_copied_buffer_is_served_only_at_the_version_it_was_copied_at():
    device = get_target().device
    resident = ResidentBuffers()
    t = torch.randn(3, 3)
    buffer = to_buffer(t, device)
    resident.remember(t, buffer, shares_memory=False, imported=False)
    assert resident.get(t) is buffer
    t.add_(1)
    assert resident.get(t) is None
    resident.remember(t, buffer, shares_memory=True, imported=False)
    t.add_(1)
    assert resident.get(t) is buffer
    assert resident.get(t.t()) is None and resident.get(t.clone()) is None
    resident.remember(t.t(), buffer, shares_memory=True, imported=False)  # a strided tensor is never remembered
    assert len(resident) == 1
