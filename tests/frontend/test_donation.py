"""Donation: programs take over the memory of arguments nothing reads after them, and of nothing else.

A backward takes over the values its forward saved (on the CPU when the runtime holds them as its own
buffers, as a plan's runner does), unless autograd keeps the graph (``retain_graph``); a step that updates
its arguments in place writes their new values into their memory on a TPU target, never into torch's memory
on the CPU. Every case is checked against eager PyTorch and against ``donate=False``.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from tpucompile import driver
from tpucompile.contracts.donation_marks import DONATABLE, SAVED, UPDATED, donated_kinds
from tpucompile.lowering import lower_graph
from tpucompile.runtime.executable import GraphExecutable

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason='libtpu is not installed (pip install "tpucompile[tpu]")')


def _mlp() -> torch.nn.Module:
    """Saved activations of 16 x 16, the shape of the first two weights' gradients: donations XLA can use."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.GELU(),
                               torch.nn.Linear(16, 4))


@pytest.fixture
def backward_calls(monkeypatch):
    """(donate flag, how many device buffer arguments were gone after the call, how many slots the program
    takes over) for every backward run through the plan's runner."""
    calls: list[tuple[bool, int, int]] = []
    original = GraphExecutable.run

    def run(self, args, donate):
        results = original(self, args, donate)
        gone = sum(a.is_deleted() for a in args if not isinstance(a, torch.Tensor))
        calls.append((donate, gone, len(self.donated_slots)))
        return results

    monkeypatch.setattr(GraphExecutable, "run", run)
    return calls


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _backward_executable() -> GraphExecutable:
    return next(e for e in reversed(driver.recent_executables()) if e.donated_slots)


def test_a_backward_takes_over_the_saved_values_and_its_gradients_equal_eager(backward_calls):
    model, reference = _mlp(), _mlp()
    compiled = torch.compile(model, backend="tpucompile", options={"cache_mode": "off"})
    x = torch.randn(16, 16)
    for _ in range(3):
        for m in (model, reference):
            m.zero_grad()
        compiled(x).square().sum().backward()
        reference(x).square().sum().backward()
        for got, want in zip(_grads(model), _grads(reference), strict=True):
            torch.testing.assert_close(got, want)
    assert _backward_executable().donated_slots, "no saved value was donated"
    assert backward_calls, "the plan's runner never ran the backward"
    for donate, gone, slots in backward_calls:  # two saved 16 x 16 values become the 16 x 16 weights' gradients
        assert donate and gone == slots == 2, "the saved device buffers were not taken over"


def test_retain_graph_keeps_the_saved_values_for_the_second_backward(backward_calls):
    model, reference = _mlp(), _mlp()
    compiled = torch.compile(model, backend="tpucompile", options={"cache_mode": "off"})
    x = torch.randn(16, 16)
    compiled(x).sum().backward()  # the first step runs through AOTAutograd; the plan's runner takes over
    for m in (model, reference):
        m.zero_grad()
    loss = compiled(x).square().sum()
    loss.backward(retain_graph=True)
    loss.backward()  # the saved values must still be there, unchanged
    expected = reference(x).square().sum()
    expected.backward(retain_graph=True)
    expected.backward()
    for got, want in zip(_grads(model), _grads(reference), strict=True):
        torch.testing.assert_close(got, want)
    kept, last = backward_calls[-2], backward_calls[-1]
    assert kept[:2] == (False, 0), "a retained graph's saved values were taken over"
    assert last[0] is True and last[1] == last[2] > 0, "the last backward of a retained graph did not donate"


def test_autograd_grad_with_retain_graph_then_backward_equals_eager():
    model, reference = _mlp(), _mlp()
    compiled = torch.compile(model, backend="tpucompile", options={"cache_mode": "off"})
    x = torch.randn(16, 16)
    compiled(x).sum().backward()
    reference(x).sum().backward()
    loss, expected = compiled(x).square().mean(), reference(x).square().mean()
    first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    want = torch.autograd.grad(expected, list(reference.parameters()), retain_graph=True)
    for a, b in zip(first, want, strict=True):
        torch.testing.assert_close(a, b)
    second = torch.autograd.grad(loss, list(model.parameters()))
    for a, b in zip(second, want, strict=True):
        torch.testing.assert_close(a, b)


def test_saved_tensors_given_to_hooks_are_never_written():
    """Under saved-tensor hooks the saved values reach the backward as torch tensors: a donated slot gets a
    fresh import of each, and the tensors the hooks hold keep their values."""
    model, reference = _mlp(), _mlp()
    compiled = torch.compile(model, backend="tpucompile", options={"cache_mode": "off"})
    x = torch.randn(16, 16)
    compiled(x).sum().backward()
    packed: list[tuple[torch.Tensor, torch.Tensor]] = []

    def pack(tensor):
        packed.append((tensor, tensor.detach().clone()))
        return tensor

    for m in (model, reference):
        m.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compiled(x).square().sum().backward()
    reference(x).square().sum().backward()
    for got, want in zip(_grads(model), _grads(reference), strict=True):
        torch.testing.assert_close(got, want)
    assert packed
    for tensor, before in packed:
        assert torch.equal(tensor, before), "a program wrote into a saved tensor's memory"


def test_donation_off_gives_the_same_gradients_and_donates_nothing():
    x = torch.randn(16, 16)
    results = {}
    for donate in (True, False):
        torch._dynamo.reset()
        model = _mlp()
        compiled = torch.compile(model, backend="tpucompile", options={"cache_mode": "off", "donate": donate})
        for _ in range(3):
            model.zero_grad()
            compiled(x).square().sum().backward()
        results[donate] = _grads(model)
        slots = [e.donated_slots for e in driver.recent_executables()[-2:]]
        assert any(slots) == donate
    for a, b in zip(results[True], results[False], strict=True):  # two programs (the host kernels are
        torch.testing.assert_close(a, b)  # chosen per program by timing): equal up to rounding


def _sgd_step(model: torch.nn.Module):
    """A whole training step: gradients by ``torch.func``, then SGD with momentum, parameters and momentum
    updated in place."""

    def step(params, momentum, x):
        def loss(values):
            return torch.func.functional_call(model, values, (x,)).square().mean()

        grads, value = torch.func.grad_and_value(loss)(params)
        with torch.no_grad():
            for name, param in params.items():
                momentum[name].mul_(0.9).add_(grads[name])
                param.sub_(momentum[name], alpha=0.1)
        return value

    return step


def _state(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return params, {k: torch.zeros_like(v) for k, v in params.items()}


def _copy(state: tuple[dict[str, torch.Tensor], ...]) -> tuple[dict[str, torch.Tensor], ...]:
    return tuple({k: v.clone() for k, v in values.items()} for values in state)


def test_an_in_place_step_on_the_cpu_never_donates_the_users_tensors():
    model = _mlp()
    state = _state(model)
    expected = _copy(state)
    x = torch.randn(16, 16)
    step = torch.compile(_sgd_step(model), backend="tpucompile", options={"cache_mode": "off"})
    held = [dict(values) for values in state]  # the caller's references to the same tensors
    for _ in range(3):
        loss = step(*state, x)
        want = _sgd_step(model)(*expected, x)
        torch.testing.assert_close(loss, want)
    for values, references, wanted in zip(state, held, expected, strict=True):
        for name in values:
            assert references[name] is values[name]
            torch.testing.assert_close(values[name], wanted[name])
    assert not driver.recent_executables()[-1].donated_slots


@needs_libtpu
def test_a_step_compiled_for_a_tpu_updates_its_parameters_in_their_memory():
    """For a TPU target each of the step's parameters and momentum buffers is donated to its new value (the
    compiler reports the aliased bytes, in its padded layouts), and with ``donate=False`` none is; the step
    still runs here, equal to eager."""
    model = _mlp()
    x = torch.randn(16, 16)
    state_bytes = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    aliased, donated = {}, {}
    for donate in (True, False):
        torch._dynamo.reset()
        events: list = []
        remove = driver.add_observer(events.append)
        state = _state(model)
        expected = _copy(state)
        try:
            step = torch.compile(_sgd_step(model), backend="tpucompile",
                                 options={"targets": ["tpu:v5e:1x1"], "cache_mode": "off", "donate": donate})
            torch.testing.assert_close(step(*state, x), _sgd_step(model)(*expected, x))
        finally:
            remove()
        for values, wanted in zip(state, expected, strict=True):
            for name in values:
                torch.testing.assert_close(values[name], wanted[name])
        (target,) = [e for e in events if e.target is not None]
        assert target.error is None, target.error
        aliased[donate] = target.report["memory"]["alias"]
        donated[donate] = sum(a is not None for a in target.program.input_aliases)
        (runtime,) = [e for e in events if e.target is None]
        assert not runtime.program.input_aliases, "the CPU program took over torch's memory"
    assert donated == {True: 2 * len(state[0]), False: 0}
    assert aliased[True] >= state_bytes and aliased[False] == 0


def _graph_with_marks(marks: dict[str, object]) -> torch.fx.GraphModule:
    """A graph (a, b, c) -> (a * 2, b + 1, c.sum(), c * 3), in that order, with donation marks on its
    placeholders."""
    graph = torch.fx.Graph()
    a, b, c = (graph.placeholder(n) for n in "abc")
    for node in (a, b, c):
        node.meta["val"] = torch.empty(4, 4)
    outputs = [graph.call_function(torch.ops.aten.mul.Tensor, (a, 2.0)),
               graph.call_function(torch.ops.aten.add.Tensor, (b, 1.0)),
               graph.call_function(torch.ops.aten.sum.default, (c,)),
               graph.call_function(torch.ops.aten.mul.Tensor, (c, 3.0))]
    for node, value in zip(outputs, (torch.empty(4, 4), torch.empty(4, 4), torch.empty(()), torch.empty(4, 4)),
                           strict=True):
        node.meta["val"] = value
    graph.output(tuple(outputs))
    for node in (a, b, c):
        if node.name in marks:
            node.meta[DONATABLE] = marks[node.name]
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_the_lowering_pairs_updated_arguments_with_their_new_values_and_saved_ones_by_shape_and_order():
    gm = _graph_with_marks({"a": 1, "b": SAVED, "c": SAVED})
    program = lower_graph(gm, donate=frozenset({SAVED, UPDATED}))
    # a's new value is output 1 (b + 1); b is last read by b + 1, so it takes the first free 4 x 4 result
    # computed after that (c * 3), not a * 2, computed before; c is read by c * 3, the last 4 x 4 result
    assert program.input_aliases == [1, 3, None]
    assert program.text(debug_info=False).count("tf.aliasing_output") == 2
    assert lower_graph(gm, donate=frozenset({SAVED})).input_aliases == [None, 3, None]
    assert lower_graph(gm).input_aliases == []
    assert "tf.aliasing_output" not in lower_graph(gm).text(debug_info=False)


def test_who_may_donate_what():
    everything = frozenset({SAVED, UPDATED})
    assert donated_kinds(True, True, "tpu", 4, False) == everything  # a compile-only slice
    assert donated_kinds(True, False, "tpu", 1, False) == everything  # arguments copied to the device
    assert donated_kinds(True, False, "cpu", 1, True) == {SAVED}  # saved values the runtime owns
    assert donated_kinds(True, False, "cpu", 1, False) == frozenset()  # torch's own memory
    assert donated_kinds(True, False, "tpu", 4, False) == frozenset()  # sharded arguments, placed per call
    assert donated_kinds(False, True, "tpu", 1, True) == frozenset()


def test_programs_that_donate_are_cached_apart_from_those_that_do_not(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUCOMPILE_CACHE_DIR", str(tmp_path))
    events: list = []
    remove = driver.add_observer(events.append)
    x = torch.randn(16, 16)
    try:
        for donate in (True, False):
            torch._dynamo.reset()
            model = copy.deepcopy(_mlp())
            compiled = torch.compile(model, backend="tpucompile", options={"donate": donate})
            compiled(x).sum().backward()
    finally:
        remove()
    backward = [e for e in events if e.name.endswith("(backward)")]
    assert len(backward) == 2
    assert backward[0].program.cache_key != backward[1].program.cache_key
    assert backward[0].key != backward[1].key
    assert backward[0].program.input_aliases and not backward[1].program.input_aliases
