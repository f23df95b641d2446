"""The per-call path of bucketed and per-size graphs: padded inputs written into one staged tensor per bucket
(``runtime/staged_inputs``), calls from several threads, and symbolic inference graphs run without
AOTAutograd's wrapper (``plan_replay.runs_direct``), each against the path without it and against eager."""

import threading
import traceback

import pytest
import torch

from tpucompile import plan_replay
from tpucompile.runtime import executable as executable_module
from tpucompile.runtime.buckets import BucketedGraph
from tpucompile.runtime.specialize import ShapeSpecializer
from tpucompile.runtime.staged_inputs import StagedInput


@pytest.mark.parametrize("shape", [(6, 5), (300, 200)], ids=["small", "past-the-grain"])
def test_a_staged_input_is_zero_outside_the_values_last_written(shape):
    staged = StagedInput(shape, torch.float32)
    rows, cols = shape
    for size in ((rows - 2, cols - 1), (rows - 4, cols), (rows, cols - 3), (1, 1), (rows, cols)):
        source = torch.randn(size)
        assert staged.take(source)
        expected = torch.zeros(shape)
        expected[:size[0], :size[1]] = source
        assert torch.equal(staged.tensor, expected), size
        staged.release()


def test_a_staged_input_refuses_what_it_cannot_hold_and_a_second_caller():
    staged = StagedInput((4, 4), torch.float32)
    assert not staged.take(torch.randn(5, 4))  # longer than the bucket
    assert not staged.take(torch.randn(4, 4, dtype=torch.float64))
    assert not staged.take(torch.randn(4))
    assert staged.take(torch.ones(2, 2))
    assert not staged.take(torch.ones(3, 3))  # held by the first call until it releases
    staged.release()
    assert staged.take(torch.ones(3, 3)) and staged.tensor.sum() == 9
    staged.release()


class _PaddingSensitive(torch.nn.Module):
    """Results that would show padding values wherever they leaked in: a sum, a cumulative sum and a softmax
    over the dynamic dimension, and a product contracting it."""

    def forward(self, x, y):
        return x.sum(0), x.cumsum(0), torch.softmax(x, dim=0), x.t() @ y, x * 3


def _imports(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of the tensors executables import from now on."""
    seen = []
    original = executable_module.GraphExecutable._imported_buffer

    def spy(self, tensor, constant):
        seen.append(tuple(tensor.shape))
        return original(self, tensor, constant)

    monkeypatch.setattr(executable_module.GraphExecutable, "_imported_buffer", spy)
    return seen


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "padded-per-call"])
def test_staged_inputs_give_eager_results_and_are_imported_once_per_bucket(staged, monkeypatch, seeded):
    model = _PaddingSensitive()
    compiled = torch.compile(model, backend="tpucompile",
                             options={"dynamic_mode": "bucket", "bucket_staged_inputs": staged})
    sizes = [13, 9, 15, 16, 5, 13, 20, 9]  # shrinking and growing inside bucket 16, then bucket 32 and back
    inputs = [(torch.randn(n, 7), torch.randn(n, 3)) for n in sizes]
    for x, y in inputs:
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(y, 0)
    with torch.no_grad():
        compiled(*inputs[0])
        imports = _imports(monkeypatch)
        for x, y in inputs[1:]:
            torch.testing.assert_close(compiled(x, y), model(x, y))
    padded_imports = [shape for shape in imports if shape in ((16, 7), (16, 3), (32, 7), (32, 3))]
    if staged:  # bucket 32's two inputs, on its first call; bucket 16's were imported by the first call
        assert padded_imports == [(32, 7), (32, 3)]
    else:
        assert len(padded_imports) == 2 * (len(sizes) - 1)


def test_threads_calling_one_bucketed_graph_each_get_their_own_results(seeded):
    """A call that finds a staged tensor taken by another thread's call pads a tensor of its own."""
    model = _PaddingSensitive()
    compiled = torch.compile(model, backend="tpucompile", options={"dynamic_mode": "bucket"})
    first = (torch.randn(40, 7), torch.randn(40, 3))
    for tensor in first:
        torch._dynamo.mark_dynamic(tensor, 0)
    with torch.no_grad():
        compiled(*first)
    per_thread = [[(torch.randn(n, 7), torch.randn(n, 3)) for n in (33, 64, 40, 50, 35) * 8] for _ in range(3)]
    failures = []

    def work(cases):
        try:
            with torch.no_grad():
                for x, y in cases:
                    torch.testing.assert_close(compiled(x, y), model(x, y))
        except Exception as error:  # reported by the main thread
            failures.append(error)

    threads = [threading.Thread(target=work, args=(cases,)) for cases in per_thread]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[0]


def _stacks_of(monkeypatch, cls) -> list[list[str]]:
    """The files on the stack of each call of ``cls`` from now on."""
    stacks = []
    original = cls.__call__

    def spy(self, args):
        stacks.append([frame.filename for frame in traceback.extract_stack()])
        return original(self, args)

    monkeypatch.setattr(cls, "__call__", spy)
    return stacks


@pytest.mark.parametrize("mode, cls", [("bucket", BucketedGraph), ("exact", ShapeSpecializer)])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "through-aotautograd"])
def test_symbolic_inference_graphs_skip_aotautograds_wrapper(mode, cls, direct, monkeypatch, seeded):
    if not direct:
        monkeypatch.setattr(plan_replay, "runs_direct", lambda *args: False)
    model = _PaddingSensitive()
    compiled = torch.compile(model, backend="tpucompile", options={"dynamic_mode": mode})
    inputs = [(torch.randn(n, 7), torch.randn(n, 3)) for n in (13, 9, 15)]
    for x, y in inputs:
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(y, 0)
    stacks = _stacks_of(monkeypatch, cls)
    with torch.no_grad():
        for x, y in inputs:
            torch.testing.assert_close(compiled(x, y), model(x, y))
    assert len(stacks) == len(inputs)
    through_aot = [any(name.endswith("runtime_wrappers.py") for name in stack) for stack in stacks]
    assert through_aot == [not direct] * len(inputs)


def test_symbolic_training_graphs_keep_aotautograds_wrapper(monkeypatch, seeded):
    """A graph that needs gradients is not an inference graph: AOTAutograd's autograd function runs it."""
    model = torch.nn.Linear(7, 3)
    compiled = torch.compile(model, backend="tpucompile", options={"dynamic_mode": "bucket"})
    stacks = _stacks_of(monkeypatch, BucketedGraph)
    for n in (13, 9):
        x = torch.randn(n, 7)
        torch._dynamo.mark_dynamic(x, 0)
        compiled(x).square().sum().backward()
        expected = torch.func.grad(lambda w, x=x: torch.func.functional_call(
            model, {"weight": w, "bias": model.bias}, (x,)).square().sum())(model.weight.detach())
        torch.testing.assert_close(model.weight.grad, expected)
        model.zero_grad()
    assert stacks and all(any(name.endswith("runtime_wrappers.py") for name in stack) for stack in stacks)
