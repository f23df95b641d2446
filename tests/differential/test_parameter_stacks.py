"""Rolled layers' parameters stacked once, outside the program (``stacked_parameters``), against the same loop
stacking them inside the program on every call and against eager: the same losses, weights and gradients over
training steps (an optimiser updating the parameters in place, gradients accumulated over micro-batches), no
copy of the weights in the program or on a steady call, and parameters whose memory changes hands (``.data``
replaced, a view of a user's tensor) read as they are on every call."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import tpucompile
from tests.differential.gpt_steps import sgd_steps, small_gpt
from tests.differential.gpt_steps import tokens as batch_of_tokens
from tpucompile import driver

LAYERS = 3


def _compiled(model, stacked: bool) -> torch.nn.Module:
    return torch.compile(model, backend="tpucompile", options={"roll_layers": True, "stacked_parameters": stacked,
                                                               "cache_mode": "off"})


def _train(stacked: bool | None):
    """``gpt_steps``' training run (None: eager): losses, final weights and gradients, the programs compiled by
    role, the model, and the calls that stacked by copy."""
    model = small_gpt(LAYERS)
    run = model if stacked is None else _compiled(model, stacked)
    events: list = []
    remove = driver.add_observer(events.append)
    copies_before = tpucompile.stats()["total"]["stack_copies"]
    try:
        losses, weights, grads = sgd_steps(model, run)
    finally:
        remove()
    copies = tpucompile.stats()["total"]["stack_copies"] - copies_before
    return losses, weights, grads, {e.name.rsplit("(", 1)[-1].rstrip(")"): e.program for e in events}, model, copies


def _concatenations(program) -> int:
    return str(program.module).count("stablehlo.concatenate")


def test_stacked_once_trains_like_stacked_per_call_and_like_eager(cache_dir):
    once, per_call, eager = _train(True), _train(False), _train(None)
    for index, what in enumerate(("losses", "weights", "grads")):
        # the loops are the same program apart from where the stacks come from: the same arithmetic
        torch.testing.assert_close(once[index], per_call[index], rtol=0, atol=0, msg=what)
        torch.testing.assert_close(once[index], eager[index], rtol=2e-4, atol=2e-5, msg=what)
    model = once[4]
    kinds = [name for name, _ in model.blocks[0].named_parameters()]
    for kind in kinds:  # each kind's layers are consecutive rows of one buffer
        rows = [model.blocks[i].get_parameter(kind) for i in range(LAYERS)]
        assert len({p.untyped_storage().data_ptr() for p in rows}) == 1, kind
        assert [p.storage_offset() for p in rows] == [i * rows[0].numel() for i in range(LAYERS)], kind
    assert once[5] == len(kinds)  # one copy per stack, on the first call; none on the 4 calls after it
    # the per-call form's forward concatenates each stack; the stacked-once forward reads them as arguments
    assert _concatenations(once[3]["forward"]) + len(kinds) <= _concatenations(per_call[3]["forward"])


def test_parameters_replaced_or_updated_outside_the_step_are_read_as_they_are(cache_dir):
    model = small_gpt(LAYERS)
    compiled = _compiled(model, True)
    tokens = batch_of_tokens(1)
    torch.testing.assert_close(compiled(tokens, tokens), model(tokens, tokens))
    weight = model.blocks[1].attn.qkv.weight
    with torch.no_grad():
        weight.mul_(0.5)  # an in-place update writes into the stack's buffer
    torch.testing.assert_close(compiled(tokens, tokens), model(tokens, tokens))
    weight.data = torch.randn_like(weight)  # new memory: the next call stacks again and takes it in
    copies = tpucompile.stats()["total"]["stack_copies"]
    expected = model(tokens, tokens)
    torch.testing.assert_close(compiled(tokens, tokens), expected)
    assert tpucompile.stats()["total"]["stack_copies"] == copies + 1
    others = model.blocks[0].attn.qkv.weight
    assert weight.untyped_storage().data_ptr() == others.untyped_storage().data_ptr()  # a row again
    state = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)  # every parameter replaced
    torch.testing.assert_close(compiled(tokens, tokens), model(tokens, tokens))


def test_a_parameter_that_views_a_users_tensor_stays_a_view_and_is_read_on_every_call(cache_dir):
    model = small_gpt(LAYERS)
    weight = model.blocks[2].mlp[0].weight
    flat = torch.zeros(weight.numel() + 8)
    with torch.no_grad():
        flat[8:].copy_(weight.reshape(-1))
    weight.data = flat[8:].view(weight.shape)  # the user's own tensor holds this layer's weight
    compiled = _compiled(model, True)
    tokens = batch_of_tokens(2)
    for scale in (1.0, 0.25):
        with torch.no_grad():
            flat.mul_(scale)
        torch.testing.assert_close(compiled(tokens, tokens), model(tokens, tokens))
        assert weight.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    loss = compiled(tokens, tokens)
    loss.backward()
    model_eager = small_gpt(LAYERS)
    model_eager.load_state_dict(model.state_dict())
    model_eager(tokens, tokens).backward()
    for (name, p), q in zip(model.named_parameters(), model_eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-4, atol=2e-5, msg=name)


@pytest.mark.parametrize("stacked", [True, False])
def test_inference_under_no_grad_reads_the_stack_without_copies(stacked, cache_dir):
    model = small_gpt(LAYERS).eval()
    compiled = _compiled(model, stacked)
    before = tpucompile.stats()["total"]["stack_copies"]
    with torch.no_grad():
        for seed in range(3):
            tokens = batch_of_tokens(seed)
            torch.testing.assert_close(compiled(tokens), model(tokens))
    copies = tpucompile.stats()["total"]["stack_copies"] - before
    assert copies == (len(list(model.blocks[0].parameters())) if stacked else 0)


@pytest.mark.parametrize("grad", [False, True])
def test_a_deleted_models_stacked_buffers_go_with_the_model(grad, cache_dir):
    """The compiled graph outlives the model (Dynamo keeps it), but not the buffers its parameters became
    views of: they go with the parameters."""
    model = small_gpt(LAYERS)
    compiled = _compiled(model, True)
    tokens = batch_of_tokens(3)
    with torch.set_grad_enabled(grad):
        out = compiled(tokens, tokens) if grad else compiled(tokens)
    if grad:
        out.backward()
    memory = weakref.ref(model.blocks[0].attn.qkv.weight.untyped_storage())
    assert model.blocks[1].attn.qkv.weight.untyped_storage() is memory()  # a row of the stack
    del model, compiled, out
    gc.collect()
    assert memory() is None


def test_two_models_of_one_class_share_the_graph_and_each_keeps_its_own_stacks(cache_dir):
    """Their parameters are the inputs of the graph Dynamo compiles once for both: calls that alternate
    between them copy nothing after each model's first."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    first, second = small_gpt(LAYERS), small_gpt(LAYERS)
    with torch.no_grad():
        for p in second.parameters():
            p.mul_(0.5)
    options = {"roll_layers": True, "cache_mode": "off"}
    compiled = [torch.compile(model, backend="tpucompile", options=options) for model in (first, second)]
    tokens = batch_of_tokens(4)
    before = tpucompile.stats()["total"]
    for _ in range(3):
        for model, run in zip((first, second), compiled, strict=True):
            with torch.no_grad():
                torch.testing.assert_close(run(tokens), model(tokens))
    after = tpucompile.stats()["total"]
    kinds = len(list(first.blocks[0].parameters()))
    assert after["stack_copies"] - before["stack_copies"] == 2 * kinds
    assert counters["stats"]["unique_graphs"] == 1


def test_frozen_stacks_beside_trained_ones_train_like_eager(cache_dir):
    """Layer norms frozen (``requires_grad=False``), the rest trained: the frozen stacks get no gradient and
    the others the eager ones."""
    results = []
    for compiled in (True, False):
        model = small_gpt(LAYERS)
        for name, p in model.named_parameters():
            p.requires_grad_(".ln_" not in name)
        run = _compiled(model, True) if compiled else model
        batch = batch_of_tokens(5)
        run(batch, batch).backward()
        results.append({name: p.grad for name, p in model.named_parameters()})
    ours, eager = results
    for name, grad in eager.items():
        if grad is None:
            assert ours[name] is None, name
        else:
            torch.testing.assert_close(ours[name], grad, rtol=2e-4, atol=2e-5, msg=name)
    assert sum(g is None for g in eager.values()) == 4 * LAYERS
