"""Tensors in and out of compiled programs: layouts, dtypes, reuse of device buffers."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from tests.support import assert_compiles_like_eager, compile_fn
from tpucompile import artifacts, driver
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
    """Neither the table nor an executable's argument slots keep a tensor alive: each input goes when the
    caller drops it, the slot's last one included."""
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
    assert [r() is None for r in inputs] == [True] * 4
    assert len(resident) <= before


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


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """No plan or program of an earlier test: the first step traces."""
    monkeypatch.setenv("TPUCOMPILE_CACHE_DIR", str(tmp_path / "cache"))
    artifacts.clear_memory()


def _silu_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 4))


def _forward_executable():
    """The forward of the training graph compiled last (AOTAutograd compiles it before the backward)."""
    return driver.recent_executables()[-2]


def test_saved_values_reach_the_backward_as_device_buffers(monkeypatch, empty_cache):
    """Once the graph runs from its plan (from the second step of a traced graph), the values the forward
    program computes for the backward are never made torch tensors: a step exports only the loss and the
    four gradients."""
    model = _silu_mlp()
    eager = copy.deepcopy(model)
    compiled = compile_fn(model)
    x = torch.randn(5, 8)
    exports = []
    real_to_tensor = executable_module.to_tensor
    monkeypatch.setattr(executable_module, "to_tensor", lambda b: exports.append(b) or real_to_tensor(b))
    for step in range(3):
        exports.clear()
        for net in (eager, compiled):
            net.zero_grad()
            net(x).square().sum().backward()
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
        computed_saved = [slot.kind for slot in _forward_executable().output_plan[1:]].count("result")
        assert computed_saved >= 2  # the SiLU's input and output, at least
        assert len(exports) == (5 if step > 0 else 5 + computed_saved), (step, len(exports))


def test_saved_device_buffers_are_freed_with_the_saved_tensors(monkeypatch, empty_cache):
    """Autograd's rules for saved tensors hold for the kept buffers: freed by the backward unless the graph
    is retained, and a second backward through a freed graph is refused."""
    compiled = compile_fn(_silu_mlp())
    x = torch.randn(5, 8)
    compiled(x).sum().backward()  # the first step compiles the backward; the plan runs from the next
    kept = []
    real_call_keeping = executable_module.GraphExecutable.call_keeping

    def recording(self, args, first_kept):
        results = real_call_keeping(self, args, first_kept)
        kept.extend(weakref.ref(r) for r in results[first_kept:] if not isinstance(r, torch.Tensor))
        return results

    monkeypatch.setattr(executable_module.GraphExecutable, "call_keeping", recording)
    compiled.zero_grad()
    loss = compiled(x).sum()
    assert kept and all(ref() is not None for ref in kept)
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in compiled.parameters()]
    gc.collect()
    assert all(ref() is not None for ref in kept)
    for p in compiled.parameters():
        p.grad = None
    loss.backward()
    for p, want in zip(compiled.parameters(), first, strict=True):
        torch.testing.assert_close(p.grad, want)
    gc.collect()
    assert all(ref() is None for ref in kept)  # ``loss`` and its graph are still alive
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


def test_saved_tensor_hooks_see_every_saved_value(empty_cache):
    """Under saved tensor hooks (offloading, compression) every saved value is packed as a tensor."""
    model = _silu_mlp()
    eager = copy.deepcopy(model)
    compiled = compile_fn(model)
    x = torch.randn(5, 8)
    compiled(x).sum().backward()
    packed = []

    def pack(tensor):
        packed.append(tuple(tensor.shape))
        return tensor.clone()

    for net in (eager, compiled):
        net.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = net(x).sum()
        if net is eager:
            packed.clear()
        loss.backward()
    saved_count = len(_forward_executable().output_plan) - 1
    assert len(packed) == saved_count and all(0 not in shape for shape in packed), packed
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
