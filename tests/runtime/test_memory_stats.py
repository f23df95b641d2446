"""``tpucompile.memory_stats()``: the bytes the runtime holds move with the buffers it makes and lets go.

Every figure is compared with sizes known from the model or from the graph, as a change from a reading taken
just before (the counts are process-wide, and other tests' compiled graphs keep their own buffers).
"""

from __future__ import annotations

import gc
import weakref

import jax
import pytest
import torch

import tpucompile

BATCH, IN, HIDDEN, OUT = 16, 64, 128, 8
FLOAT = 4


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))


def _parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _held() -> dict:
    gc.collect()
    return tpucompile.memory_stats("cpu:0")


def _change(after: dict, before: dict, part: str = "held") -> dict:
    return {use: after[part][use] - before[part][use] for use in after[part]}


@pytest.fixture(autouse=True)
def collect_only_when_told():
    """No automatic garbage collection during a test: the counts move only where the test frees something
    (``_held`` collects), not where an earlier test's garbage happens to go."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_inference_holds_parameters_last_input_and_live_outputs(compile_events):
    torch.manual_seed(0)
    model = _model()
    compiled = torch.compile(model, backend="tpucompile")
    x = torch.randn(BATCH, IN)
    before = _held()
    with torch.no_grad():
        y = compiled(x)
    after = _held()
    change = _change(after, before)
    assert change["parameters"] == _parameter_bytes(model)
    assert change["inputs"] == x.nbytes
    assert change["outputs"] == y.nbytes == BATCH * OUT * FLOAT
    assert change["saved_activations"] == change["constants"] == 0
    # On the CPU the arguments are imported without a copy: torch's memory, counted as shared; the result
    # is memory the runtime allocated.
    assert _change(after, before, "shared")["parameters"] == _parameter_bytes(model)
    assert after["own"] - before["own"] == y.nbytes

    del y
    assert _change(_held(), before)["outputs"] == 0

    with torch.no_grad():  # a new batch: the buffer of the last one goes, the parameters' stay
        batch = torch.randn(BATCH, IN)
        compiled(batch)
    change = _change(_held(), before)
    assert change["inputs"] == x.nbytes and change["outputs"] == 0
    assert change["parameters"] == _parameter_bytes(model)
    del batch  # and an input's buffer goes with the input
    assert _change(_held(), before)["inputs"] == 0

    # XLA's analysis of the program: the arguments and the result as known, and the hidden layer as a
    # temporary (it lies between two products, in neither the arguments nor the results).
    name = next(event.name for event in compile_events if event.name.endswith("(inference)"))
    figures = tpucompile.memory_stats()["graphs"][name]
    assert figures["executables"] == 1
    assert figures["arguments"] == _parameter_bytes(model) + x.nbytes
    assert figures["outputs"] == BATCH * OUT * FLOAT
    assert figures["temporaries"] >= BATCH * HIDDEN * FLOAT
    assert tpucompile.memory_stats("tpu:0")["graphs"] == {}


def test_a_deleted_models_parameters_go_with_the_model():
    """A compiled graph lives as long as Dynamo keeps it (past ``torch._dynamo.reset()``: Dynamo installs it
    as a global of the traced code's module), but it does not keep the buffers of a deleted model's
    parameters: they go with the model, before the graph runs again, and the parameters with them."""
    torch.manual_seed(0)
    first, second = _model(), _model()
    with torch.no_grad():
        torch.compile(first, backend="tpucompile")(torch.randn(BATCH, IN))
        before = _held()
        weight = weakref.ref(first[0].weight)
        del first
        gone = _held()
        assert weight() is None
        assert _change(gone, before)["parameters"] == -_parameter_bytes(second)
        torch.compile(second, backend="tpucompile")(torch.randn(BATCH, IN))
    assert _change(_held(), before)["parameters"] == 0  # the second model's, in place of the first's


def test_twenty_compiled_models_created_and_dropped_leave_memory_flat():
    """A server that builds models and drops them (with ``torch._dynamo.reset()``), in turn for inference
    and for a training step: every device buffer the runtime held for one is gone after it, whatever the
    graphs Dynamo keeps, and so are its parameters."""
    models = []
    baseline = None
    for index in range(20):
        training = index % 2 == 1
        torch.manual_seed(index)
        model = torch.nn.Sequential(torch.nn.Linear(IN, 4 * HIDDEN), torch.nn.GELU(), torch.nn.Linear(4 * HIDDEN, OUT))
        compiled = torch.compile(model, backend="tpucompile")
        x = torch.randn(BATCH, IN)
        if training:
            compiled(x).square().mean().backward()
        else:
            with torch.no_grad():
                compiled(x)
        models.append(weakref.ref(model[0].weight))
        del model, compiled, x
        torch._dynamo.reset()
        held = _held()["held"]
        baseline = held if baseline is None else baseline
        assert held == baseline, (index, held, baseline)
    assert all(reference() is None for reference in models)


def test_training_holds_saved_activations_until_the_backward(compile_events):
    torch.manual_seed(0)
    model = _model()
    compiled = torch.compile(model, backend="tpucompile")
    compiled(torch.randn(BATCH, IN)).sum().backward()  # compiles; later steps run the plan's runner
    saved = next(event.saved_for_backward() for event in compile_events if event.name.endswith("(backward)"))
    assert saved["activations"] > 0

    before = _held()
    tpucompile.reset_peak_memory_stats()
    assert tpucompile.memory_stats("cpu:0")["peak"] == {"held": before["held"]["total"], "own": before["own"]}
    out = compiled(torch.randn(BATCH, IN))
    forward = _held()
    assert _change(forward, before)["saved_activations"] == saved["activations"]
    assert _change(forward, before)["outputs"] == out.nbytes
    out.sum().backward()
    backward = _held()
    assert _change(backward, before)["saved_activations"] == 0
    # The high-water mark saw the saved values and the output together, and stays after they are gone.
    assert backward["peak"]["own"] - before["own"] >= saved["activations"] + out.nbytes
    tpucompile.reset_peak_memory_stats("cpu:0")
    assert tpucompile.memory_stats("cpu:0")["peak"]["own"] == backward["own"]

    # The gradients are program results that the parameters' .grad hold: they go with them.
    gradients = sum(p.grad.nbytes for p in model.parameters())
    assert backward["held"]["outputs"] - before["held"]["outputs"] == out.nbytes
    del out
    model.zero_grad(set_to_none=True)
    assert _change(_held(), before)["outputs"] == -gradients

    names = tpucompile.memory_stats()["graphs"]
    assert {event.name for event in compile_events} <= set(names)
    backward_figures = names[next(e.name for e in compile_events if e.name.endswith("(backward)"))]
    assert backward_figures["arguments"] > 0 and backward_figures["outputs"] >= gradients


TABLE = [float(i) for i in range(2048)]
"""A literal larger than the embedding limit (1024 elements): the graph passes it to its program."""


def test_a_large_constant_is_held_as_a_constant():
    def shifted(x):
        return x + torch.tensor(TABLE)

    x = torch.randn(len(TABLE))
    before = _held()
    with torch.no_grad():
        y = torch.compile(shifted, backend="tpucompile")(x)
    torch.testing.assert_close(y, shifted(x), rtol=0, atol=0)
    change = _change(_held(), before)
    assert change["constants"] == len(TABLE) * FLOAT
    assert change["inputs"] == x.nbytes and change["outputs"] == y.nbytes


def test_device_selection():
    device = jax.devices("cpu")[0]
    by_name = tpucompile.memory_stats("cpu:0")
    assert tpucompile.memory_stats(device)["held"] == by_name["held"]
    assert tpucompile.memory_stats(torch.device("cpu", 0))["held"] == by_name["held"]
    assert tpucompile.memory_stats(0)["device"] == "cpu:0"
    assert tpucompile.memory_stats("cpu")["held"] == by_name["held"]
    assert tpucompile.memory_stats()["held"] == by_name["held"]  # this process runs on one device
    nowhere = tpucompile.memory_stats("tpu:0")
    assert nowhere["held"]["total"] == 0 and nowhere["graphs"] == {}
    with pytest.raises(ValueError, match="not a device"):
        tpucompile.memory_stats("cpu:first")
