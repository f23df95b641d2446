"""Warm starts skip AOTAutograd: a cached plan rebuilds the compiled graph from its programs alone."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.cached_runs import fresh_start, run_workload, workload_env
from tpucompile import artifacts
from tpucompile.cache import LocalStore, decode


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 3))


def _train_step(model, x, compile_it: bool):
    """Loss and gradients of one step, with the events of what tpucompile compiled or loaded."""
    with fresh_start() as events:  # only the disk is warm
        run = torch.compile(model, backend="tpucompile") if compile_it else model
        model.zero_grad()
        out = run(x)
        loss = out.pow(2).sum() + out.detach().sum()  # the second output use is not differentiated
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], events


def test_warm_training_step_runs_from_the_plan_without_aot_autograd(cache_dir):
    model, x = _model(), torch.randn(5, 6)
    expected_loss, expected_grads, _ = _train_step(model, x, compile_it=False)
    cold_loss, cold_grads, cold = _train_step(model, x, compile_it=True)
    warm_loss, warm_grads, warm = _train_step(model, x, compile_it=True)
    assert [e.graph is not None for e in cold] == [True, True]
    assert [(e.name.split()[-1], e.graph, e.tier) for e in warm] == [
        ("(forward)", None, "local"), ("(backward)", None, "local")
    ]
    for loss, grads in ((cold_loss, cold_grads), (warm_loss, warm_grads)):
        torch.testing.assert_close(loss, expected_loss)
        for got, want in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(got, want)
    store = LocalStore(cache_dir)
    kinds = sorted(decode(store.read(k), k).kind for k in store.list_keys())
    assert kinds.count("plan") == 1


def test_a_traced_graph_runs_from_its_plan_after_its_first_backward(cache_dir):
    """A process that traced the graph switches to the plan's runner once AOTAutograd has compiled the
    backward (at the first backward), so it runs its steps as a warm start would."""
    model, x = _model(), torch.randn(5, 6)
    eager = copy.deepcopy(model)
    with fresh_start() as events:
        compiled = torch.compile(model, backend="tpucompile")
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model)]
        nodes = []
        for _ in range(3):
            for net, optimizer in zip((eager, compiled), optimizers, strict=True):
                optimizer.zero_grad()
                out = net(x)
                out.square().sum().backward()
                optimizer.step()
            nodes.append(type(out.grad_fn).__name__)
    assert [e.graph is not None for e in events] == [True, True]
    assert nodes == ["CompiledFunctionBackward", "CompiledGraphBackward", "CompiledGraphBackward"]
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_a_weight_changed_in_place_before_the_backward_is_reported(cache_dir):
    """The weights a plan's forward saves are saved as tensors, so autograd's version check still applies."""
    model, x = _model(), torch.randn(5, 6)
    compiled = torch.compile(model, backend="tpucompile")
    compiled(x).sum().backward()
    loss = compiled(x).sum()
    assert type(loss.grad_fn.next_functions[0][0]).__name__ == "CompiledGraphBackward"
    with torch.no_grad():
        model[2].weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_compiled_autograd_calls_the_plans_backward_program_without_tracing_into_it(cache_dir):
    """Compiled autograd traces Python autograd.Functions' backwards with Dynamo; the plan's backward program
    call must stay opaque to it (traced, the runtime's per-tensor lookups would recompile every step)."""
    model, x = _model(), torch.randn(5, 6)
    _train_step(model, x, compile_it=True)  # stores the plan
    eager = copy.deepcopy(model)
    with fresh_start() as events, torch._dynamo.config.patch(error_on_recompile=True):
        compiled = torch.compile(model, backend="tpucompile")
        for _ in range(3):
            for net in (eager, compiled):
                net.zero_grad()
                loss = net(x).square().sum()
                if net is compiled:
                    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
                        loss.backward()
                else:
                    loss.backward()
            for p, q in zip(model.parameters(), eager.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad)
    assert [e.graph for e in events] == [None, None]


def test_non_differentiable_outputs_and_unused_gradients(cache_dir):
    def fn(x, w, b):
        h = torch.tanh(x @ w)
        return h, h.argmax(dim=1), (h * b).sum(dim=0)

    x, w, b = torch.randn(5, 4), torch.randn(4, 3, requires_grad=True), torch.randn(3, requires_grad=True)
    expected = fn(x, w, b)
    expected[0].sum().backward()
    want_w, want_b = w.grad.clone(), b.grad
    for traced in (True, False):
        w.grad = b.grad = None
        with fresh_start() as events:
            h, index, third = torch.compile(fn, backend="tpucompile")(x, w, b)
            h.sum().backward()  # no gradient flows into ``third``; ``index`` is not differentiable
        assert [e.graph is not None for e in events] == [traced, traced]
        assert not index.requires_grad and third.requires_grad
        torch.testing.assert_close(index, expected[1])
        torch.testing.assert_close(third, expected[2].detach())
        torch.testing.assert_close(w.grad, want_w)
        torch.testing.assert_close(b.grad, torch.zeros_like(b) if want_b is None else want_b)


def test_warm_inference_runs_from_the_plan(cache_dir):
    model, x = _model(), torch.randn(5, 6)
    expected = model(x).detach()
    for traced in (True, False):
        with fresh_start() as events, torch.no_grad():
            result = torch.compile(model, backend="tpucompile")(x)
        torch.testing.assert_close(result, expected)
        assert [e.graph is not None for e in events] == [traced]


def test_graphs_indexing_with_an_ellipsis_get_a_plan(cache_dir):
    """Indexing with ``...`` (``h[..., half:]``, as Llama's rotary embedding does): the Dynamo graph holds an
    Ellipsis, which the plan key encodes (and keeps apart from the same slice without it)."""
    def rotate(x, w):
        h = x @ w
        half = h.shape[-1] // 2
        return torch.cat((-h[..., half:], h[..., :half]), dim=-1) * h

    x, w = torch.randn(2, 3, 8), torch.randn(8, 8, requires_grad=True)
    rotate(x, w).sum().backward()
    expected = w.grad.clone()
    for traced in (True, False):
        w.grad = None
        with fresh_start() as events:
            torch.compile(rotate, backend="tpucompile")(x, w).sum().backward()
        assert [e.graph is not None for e in events] == [traced, traced]
        torch.testing.assert_close(w.grad, expected)
    bindings = None
    assert artifacts.encode_argument((Ellipsis, slice(None, 4)), bindings) != artifacts.encode_argument(
        (slice(None, 4),), bindings)


def test_graphs_returning_a_view_of_an_intermediate_get_a_plan(cache_dir):
    """An output that is a view of an intermediate no other output aliases (DLRM's ``logits.squeeze(1)``):
    AOTAutograd only hides the aliasing from autograd, so the plan's runner returns the result as it is."""
    def score(x, w):
        return torch.tanh(x @ w).squeeze(1)

    x, w = torch.randn(5, 4), torch.randn(4, 1, requires_grad=True)
    expected = score(x, w)
    expected.square().sum().backward()
    want = w.grad.clone()
    for traced in (True, False):
        w.grad = None
        with fresh_start() as events:
            out = torch.compile(score, backend="tpucompile")(x, w)
            out.square().sum().backward()
        assert [e.graph is not None for e in events] == [traced, traced]
        assert out.shape == (5,) and out._base is None
        torch.testing.assert_close(out, expected.detach())
        torch.testing.assert_close(w.grad, want)
        out.add_(1)  # a fresh tensor: changing it disturbs nothing the backward needs


def test_batch_norm_training_runs_from_the_plan_and_updates_running_statistics(cache_dir):
    """BatchNorm in training updates its running statistics in place: the forward returns their new values
    first, and the plan's runner copies them into the buffers as AOTAutograd's wrapper does."""
    torch.manual_seed(0)
    initial = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(),
                                  torch.nn.Linear(6, 2))
    x = torch.randn(8, 4)
    eager = copy.deepcopy(initial)
    for _ in range(2):
        eager(x).square().sum().backward()
    for traced in (True, False):
        model = copy.deepcopy(initial)
        with fresh_start() as events:
            compiled = torch.compile(model, backend="tpucompile")
            for _ in range(2):  # the second step must see the first one's running statistics
                compiled(x).square().sum().backward()
        assert [e.graph is not None for e in events] == [traced, traced]
        for (name, got), want in zip(model.state_dict().items(), eager.state_dict().values(), strict=True):
            torch.testing.assert_close(got, want, msg=name)
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    store = LocalStore(cache_dir)
    assert [decode(store.read(k), k).kind for k in store.list_keys()].count("plan") == 1


def _traced_twice(fn, make_args, grad: bool = True):
    """Whether each of two fresh compiles of ``fn`` (on fresh arguments, with a backward where there is a
    gradient) traced (True) or ran from a plan (False), per graph."""
    seen = []
    for _ in range(2):
        with fresh_start() as events, torch.set_grad_enabled(grad):
            out = torch.compile(fn, backend="tpucompile")(*make_args())
            if out.requires_grad:
                out.sum().backward()
        seen.append([e.graph is not None for e in events])
    return seen


def test_mutations_a_plan_cannot_replay_get_no_plan(cache_dir):
    """Updates inside inference programs and updates of arguments that need gradients need AOTAutograd's
    wrapper: those graphs are traced every time."""
    def update_buffer(x, buffer):
        buffer.add_(x.sum(0))
        return x * buffer

    def update_needing_grad(x, w):
        x.mul_(2)
        return x @ w

    w = torch.randn(4, 4, requires_grad=True)
    assert _traced_twice(update_buffer, lambda: (torch.randn(3, 4), torch.zeros(4)), grad=False) == [[True]] * 2
    needing_grad = _traced_twice(update_needing_grad, lambda: (torch.randn(3, 4, requires_grad=True) * 1, w))
    assert needing_grad == [[True, True]] * 2 and w.grad is not None
    store = LocalStore(cache_dir)
    assert "plan" not in {decode(store.read(k), k).kind for k in store.list_keys()}


def test_corrupt_plan_is_quarantined_and_the_graph_traced_again(cache_dir):
    model, x = _model(), torch.randn(5, 6)
    expected_loss, _, _ = _train_step(model, x, compile_it=False)
    _train_step(model, x, compile_it=True)
    store = LocalStore(cache_dir)
    (plan_key,) = [k for k in store.list_keys() if decode(store.read(k), k).kind == "plan"]
    path = store.path(plan_key)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    loss, _, events = _train_step(model, x, compile_it=True)
    torch.testing.assert_close(loss, expected_loss)
    assert all(e.graph is not None for e in events)


def test_fresh_process_training_step_skips_aot_autograd(tmp_path):
    env = workload_env(tmp_path / "cache")
    cold = run_workload(env, ["--train"])
    warm = run_workload(env, ["--train"])
    assert cold["ok"] and warm["ok"]
    assert [e["traced"] for e in cold["events"]] == [True, True]
    assert [e["traced"] for e in warm["events"]] == [False, False]
    assert [e["tier"] for e in warm["events"]] == ["local", "local"]
