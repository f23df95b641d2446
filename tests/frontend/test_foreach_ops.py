"""PyTorch's ``_foreach_*`` ops (multi-tensor optimizers, ``clip_grad_norm_``, ``zero_grad``) compile into
per-element ops: each overload's decomposition against the eager op, compiled functions and every
``torch.optim`` optimizer with ``foreach=True`` against eager with eager fallback refused, and a sharded step
(which compiles as one program, so an op without a lowering cannot run eagerly there)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.support import assert_compiles_like_eager
from tpucompile import Mesh, driver, fully_sharded
from tpucompile.frontend.foreach_ops import foreach_decompositions

SHAPES = [(3, 4), (5,), ()]


def _tensors(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Values in (0.1, 0.9): inside every unary op's domain (log, sqrt, acos, lgamma ...) and valid lerp weights."""
    return [(torch.rand(shape) * 0.8 + 0.1).to(dtype) for shape in SHAPES]


def _sample_arguments(schema: torch._C.FunctionSchema) -> tuple[list, dict]:
    positional, keywords = [], {}
    for argument in schema.arguments:
        kind = str(argument.type)
        if kind == "List[Tensor]":
            value = _tensors()
        elif kind == "List[number]":
            value = [0.5, 1.5, 2.0]
        elif argument.name == "scalars" and kind == "Tensor":
            value = torch.tensor([0.5, -1.5, 2.0])
        elif kind == "Tensor":
            value = torch.tensor(1.25)
        elif kind == "number":
            value = 3 if argument.name == "ord" else 0.75
        elif argument.default_value is not None or "Optional" in kind:
            continue  # the schema's default
        else:
            raise AssertionError(f"no sample for {argument.name}: {kind} in {schema}")
        (keywords.__setitem__(argument.name, value) if argument.kwarg_only else positional.append(value))
    return positional, keywords


def test_every_functional_overload_decomposes_like_the_eager_op():
    table = foreach_decompositions()
    names = {overload._schema.name for overload in table}
    # the ops torch.optim's multi-tensor paths, clip_grad_norm_ and zero_grad call are all there
    for name in ("add", "sub", "mul", "div", "addcmul", "addcdiv", "lerp", "sqrt", "neg", "pow", "maximum",
                 "norm", "zero", "copy", "reciprocal", "sign", "clamp_min", "max", "abs", "exp"):
        assert f"aten::_foreach_{name}" in names, name
    checked = 0
    for overload, per_element in table.items():
        if overload._schema.name == "aten::_foreach_mm":
            positional, keywords = [[torch.randn(2, 3), torch.randn(4, 2)], [torch.randn(3, 5), torch.randn(2, 2)]], {}
        else:
            positional, keywords = _sample_arguments(overload._schema)
        expected = overload(*positional, **keywords)
        actual = per_element(*positional, **keywords)
        assert len(actual) == len(expected), overload
        for a, e in zip(actual, expected, strict=True):
            assert a.dtype == e.dtype and a.shape == e.shape, (overload, a.dtype, e.dtype, a.shape, e.shape)
            torch.testing.assert_close(a, e, equal_nan=True, msg=lambda m, o=overload: f"{o}: {m}")
        checked += 1
    assert checked == len(table) >= 70


def test_integer_lists_promote_as_the_eager_ops_do():
    table = foreach_decompositions()
    integers = [torch.arange(4), torch.arange(3, dtype=torch.int32)]
    for overload, args in ((torch.ops.aten._foreach_add.Scalar, (integers, 0.5)),
                           (torch.ops.aten._foreach_div.Scalar, (integers, 2)),
                           (torch.ops.aten._foreach_mul.Tensor, (integers, torch.tensor(2.5)))):
        for a, e in zip(table[overload](*args), overload(*args), strict=True):
            assert a.dtype == e.dtype
            torch.testing.assert_close(a, e)


def _uses_of_foreach(xs: list[torch.Tensor], ys: list[torch.Tensor], scale: torch.Tensor) -> list[torch.Tensor]:
    moved = torch._foreach_mul(xs, 0.9)
    torch._foreach_addcmul_(moved, ys, ys, value=0.1)
    torch._foreach_lerp_(moved, ys, 0.25)
    roots = torch._foreach_sqrt(torch._foreach_abs(moved))
    torch._foreach_add_(roots, 1e-3)
    steps = torch._foreach_addcdiv(xs, ys, roots, value=-0.5)
    norms = torch._foreach_norm(steps, 2)
    total = torch.linalg.vector_norm(torch.stack(norms), 2)
    torch._foreach_mul_(steps, torch.clamp(1.0 / (total + 1e-6), max=1.0))
    torch._foreach_maximum_(steps, -0.75)
    powers = torch._foreach_pow(2.0, torch._foreach_sign(steps))
    return [*steps, *powers, scale * total]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_function_of_foreach_ops_compiles_whole_and_matches_eager(dtype):
    xs = [torch.randn(shape).to(dtype) for shape in SHAPES]
    ys = [torch.randn(shape).to(dtype) for shape in SHAPES]
    assert_compiles_like_eager(_uses_of_foreach, xs, ys, torch.tensor(2.0), fallback="error")


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2,
                                          foreach=True),
    "adam_amsgrad": lambda params: torch.optim.Adam(params, lr=1e-2, amsgrad=True, foreach=True),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-2, centered=True, momentum=0.5, foreach=True),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=1e-2, foreach=True),
    "adamax": lambda params: torch.optim.Adamax(params, lr=1e-2, foreach=True),
    "nadam": lambda params: torch.optim.NAdam(params, lr=1e-2, foreach=True),
    "radam": lambda params: torch.optim.RAdam(params, lr=1e-2, foreach=True),
    "adadelta": lambda params: torch.optim.Adadelta(params, foreach=True),
}


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                               torch.nn.Linear(16, 4))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_multi_tensor_optimizers_step_like_eager(name):
    """Three compiled steps (with gradient clipping over the list, as training loops do) against three eager
    ones: parameters and every state tensor."""
    torch.manual_seed(0)
    eager_model = _model()
    compiled_model = copy.deepcopy(eager_model)
    optimizers = [OPTIMIZERS[name](m.parameters()) for m in (eager_model, compiled_model)]

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=True)
        optimizer.step()

    torch._dynamo.reset()  # not fullgraph: optimizer.step breaks the graph around itself, on purpose
    compiled_step = torch.compile(step, backend="tpucompile", options={"fallback": "error"})
    before = driver.graphs_compiled()
    for _ in range(3):
        batch = torch.randn(6, 8)
        for model, optimizer in zip((eager_model, compiled_model), optimizers, strict=True):
            optimizer.zero_grad()
            model(batch).square().mean().backward()
        step(eager_model, optimizers[0])
        compiled_step(compiled_model, optimizers[1])
    assert driver.graphs_compiled() > before
    for eager, compiled in zip(eager_model.parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    for eager, compiled in zip(optimizers[0].state.values(), optimizers[1].state.values(), strict=True):
        for key, value in eager.items():
            torch.testing.assert_close(compiled[key], value, atol=1e-5, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


def test_a_sharded_multi_tensor_step_compiles_as_one_program():
    """Under a mesh a graph compiles as one program; the foreach ops have no eager way out there."""
    torch.manual_seed(0)
    mesh = Mesh({"data": 1})
    eager_model = _model()
    compiled_model = copy.deepcopy(eager_model)
    batch = torch.randn(6, 8)
    for model in (eager_model, compiled_model):
        model(batch).sum().backward()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) for m in (eager_model, compiled_model)]
    compiled_step = torch.compile(optimizers[1].step, backend="tpucompile",
                                  options={"mesh": mesh, "shard": fully_sharded(mesh)})
    for _ in range(2):
        optimizers[0].step()
        compiled_step()
    for eager, compiled in zip(eager_model.parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-6)
