"""A rolled backward returns its layers' weight gradients stacked, once, each gradient a view of its layer
(``stacked_layer_outputs``), against the form with one result per layer and against eager: the same values,
training steps included (gradients accumulated into views, an optimiser updating them in place). The weights
are stacked inside the program here (``stacked_parameters=False``), as they are where they cannot be stacked
once outside it (``test_parameter_stacks.py``), which is the form whose gradients come out per layer."""

from __future__ import annotations

import pytest
import torch

from tests.differential.gpt_steps import sgd_steps, small_gpt
from tpucompile import driver


def _steps(stacked: bool | None):
    """``gpt_steps``' training run of a 3-layer GPT: the losses, the final weights and gradients, the backward
    programs (None: eager), and the model."""
    model = small_gpt(3)
    run = model if stacked is None else torch.compile(model, backend="tpucompile", options={
        "roll_layers": True, "stacked_layer_outputs": stacked, "stacked_parameters": False, "cache_mode": "off"})
    events: list = []
    remove = driver.add_observer(events.append)
    try:
        losses, weights, grads = sgd_steps(model, run)
    finally:
        remove()
    backwards = [e.program for e in events if e.name.endswith("(backward)")]
    return losses, weights, grads, backwards, model


def test_stacked_gradients_are_views_of_one_result_and_train_like_per_layer_results(cache_dir):
    stacked = _steps(True)
    per_layer = _steps(False)
    eager = _steps(None)
    for name in ("losses", "weights", "grads"):
        index = ("losses", "weights", "grads").index(name)
        torch.testing.assert_close(stacked[index], per_layer[index], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(stacked[index], eager[index], rtol=2e-4, atol=2e-5, msg=name)
    (program,), (unstacked,) = stacked[3], per_layer[3]
    parts = [slot for slot in program.output_plan if slot.part is not None]
    assert len(parts) == 3 * 12 and not any(slot.part is not None for slot in unstacked.output_plan)
    assert len(program.result_specs) == len(unstacked.result_specs) - len(parts) + len(parts) // 3
    model = stacked[4]
    layer_grads = [p.grad for name, p in model.named_parameters() if name.startswith("blocks.")]
    assert len({g.untyped_storage().data_ptr() for g in layer_grads}) == 12  # one stack per weight kind
    assert all(g.is_contiguous() for g in layer_grads)


@pytest.mark.parametrize("layers, folded", [(3, True), (1, False)])
def test_only_every_layer_of_a_stack_folds(layers, folded, cache_dir):
    """One layer rolls nothing; the plain outputs keep a result each."""
    model = small_gpt(layers)
    compiled = torch.compile(model, backend="tpucompile", options={"roll_layers": True, "stacked_parameters": False,
                                                                   "cache_mode": "off"})
    events: list = []
    remove = driver.add_observer(events.append)
    try:
        tokens = torch.randint(0, 64, (2, 16))
        compiled(tokens, tokens).backward()
    finally:
        remove()
    (backward,) = [e.program for e in events if e.name.endswith("(backward)")]
    assert any(slot.part is not None for slot in backward.output_plan) == folded


def test_a_compile_only_run_makes_every_layer_a_view_of_one_stack():
    """What a compile-only program hands back for a stacked result is shaped like a run's: one tensor per
    stack, every layer's output a view of it (one stack per layer would hold the layers' memory that many
    times over)."""
    from tpucompile.contracts.calling_convention import OutputSlot
    from tpucompile.runtime import ShapeOnlyExecutable

    plan = [OutputSlot("result", 0, part=layer) for layer in range(3)] + [OutputSlot("result", 1)]
    executable = ShapeOnlyExecutable(plan, [((3, 4, 5), torch.float32), ((2,), torch.float32)], [None] * 4)
    layers = executable([torch.zeros(1)])
    assert [tuple(t.shape) for t in layers] == [(4, 5), (4, 5), (4, 5), (2,)]
    bases = {t._base.data_ptr() for t in layers[:3]}
    assert len(bases) == 1 and all(t._base.shape == (3, 4, 5) for t in layers[:3]), bases
