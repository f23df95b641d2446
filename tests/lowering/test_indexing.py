"""Indexing, gather and scatter lowerings against eager PyTorch.

Two kinds of checks: ``torch.compile`` end to end (the ``aten_ops`` fixture records which ATen ops reached
the backend, so each test proves it exercised the rule it is named after), and, for ops that AOTAutograd's
decomposition table always rewrites before they reach us, the rule alone on a graph traced with ``make_fx``
and no decompositions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from jax.extend.mlir import ir
from torch.fx.experimental.proxy_tensor import make_fx

from tests.support import assert_close_tree, assert_compiles_like_eager
from tpucompile import driver
from tpucompile.config import Options
from tpucompile.errors import UnsupportedOpError
from tpucompile.lowering import builder
from tpucompile.lowering.context import mlir_context
from tpucompile.lowering.rules import indexing

aten = torch.ops.aten

FLOAT_DTYPES = [torch.float32, torch.bfloat16]
VALUE_DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def values(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(-50, 50, shape, dtype=dtype)


def assert_rule_like_eager(fn: Callable, *inputs: Any, op: torch._ops.OpOverload) -> None:
    """Trace ``fn`` to ATen without decompositions, check ``op`` is in the graph, and run it through
    tpucompile's graph compiler (the rule alone, as if AOTAutograd had left the op in place)."""
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    ops = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert op in ops, f"{op} not in traced graph: {sorted(map(str, ops))}"
    compiled = driver.compile_graph(gm, list(inputs), Options(), "test_indexing")
    (actual,) = compiled(list(inputs))
    assert_close_tree(actual, fn(*inputs))


# --- aten.index.Tensor --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
def test_index_single_negative(aten_ops, dtype):
    x = values((6, 5), dtype)
    assert_compiles_like_eager(lambda x, i: x[i], x, torch.tensor([0, -1, 3, -6, 3]))
    assert aten.index.Tensor in aten_ops


def test_index_2d_index_and_scalar_index(aten_ops):
    x = torch.randn(6, 5, 4)
    assert_compiles_like_eager(lambda x, i: x[:, i], x, torch.tensor([[0, -1], [4, 2], [1, 1]]))
    assert aten.index.Tensor in aten_ops
    # x[0-d tensor] becomes a data-dependent select in Dynamo; the ATen op itself takes a 0-d index fine.
    assert_rule_like_eager(lambda x, i: aten.index(x, [None, i]), x, torch.tensor(-2), op=aten.index.Tensor)


def test_index_adjacent_broadcast(aten_ops):
    x = torch.randn(3, 6, 5, 4)
    i = torch.tensor([[0], [-1], [2]])  # (3, 1) broadcasts with (4,) to (3, 4)
    j = torch.tensor([4, 0, -5, 1])
    out = assert_compiles_like_eager(lambda x, i, j: x[:, i, j], x, i, j)
    assert out.shape == (3, 3, 4, 4)
    assert aten.index.Tensor in aten_ops


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
def test_index_non_adjacent(aten_ops, dtype):
    x = values((3, 6, 5, 7), dtype)
    i = torch.tensor([0, -1, 2, 5])
    j = torch.tensor([[6], [-7]])
    out = assert_compiles_like_eager(lambda x, i, j: x[:, i, :, j], x, i, j)
    assert out.shape == (2, 4, 3, 5)  # broadcast index dims go first when the indexed dims are not adjacent
    k = torch.tensor([[2], [-3]])
    out = assert_compiles_like_eager(lambda x, k, j: x[k, :, :, j], x, k, j)  # indexed dims 0 and 3
    assert out.shape == (2, 1, 6, 5)
    assert aten.index.Tensor in aten_ops


def test_index_int32_indices(aten_ops):
    x = torch.randn(5, 4)
    assert_compiles_like_eager(lambda x, i: x[:, i], x, torch.tensor([3, -4, 0], dtype=torch.int32))
    assert aten.index.Tensor in aten_ops


def test_index_grad(aten_ops):
    x = torch.randn(4, 6, 5)
    i = torch.tensor([0, -1, 2, 2, 0])  # duplicates: the backward accumulates
    j = torch.tensor([1, 1, -1, 3, 0])
    assert_compiles_like_eager(lambda x, i, j: x[i, :, j] * 2, x, i, j, grad=True)
    assert {aten.index.Tensor, aten.index_put.default} <= aten_ops


def test_index_bool_mask_refused():
    x = torch.randn(4, 5)
    with pytest.raises(Exception) as info:
        assert_compiles_like_eager(lambda x, m: x[m], x, x > 0)
    chain, error = [], info.value
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    assert any(isinstance(e, UnsupportedOpError) for e in chain), chain


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8])
def test_index_mask_rule_refuses(mask_dtype):
    """End to end, a mask fails earlier (its size is data-dependent); the rule refuses one on its own too."""
    with mlir_context(), ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            x = builder.constant(1.0, torch.float32, (4,))
            mask = builder.constant(1, mask_dtype, (4,))
            with pytest.raises(UnsupportedOpError, match="mask"):
                indexing._take(x, [mask])


def test_unsafe_index():
    x = torch.randn(5, 6)
    i = torch.tensor([[0, -1], [5, 2]])
    assert_rule_like_eager(lambda x, i: aten._unsafe_index(x, [None, i]), x, i, op=aten._unsafe_index.Tensor)


# --- aten.index_put.default ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
def test_index_put_replace(aten_ops, dtype):
    x = values((6, 4), dtype)
    i = torch.tensor([0, -1, 3])
    assert_compiles_like_eager(lambda x, i, v: x.index_put((i,), v), x, i, values((3, 4), dtype))
    assert_compiles_like_eager(lambda x, i, v: x.index_put((i,), v), x, i, values((4,), dtype))  # broadcast
    assert_compiles_like_eager(lambda x, i, v: x.index_put((i,), v), x, i, values((), dtype))
    assert aten.index_put.default in aten_ops


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
def test_index_put_accumulate_duplicates(aten_ops, dtype):
    x = values((5, 3), dtype)
    i = torch.tensor([1, -4, 1, 0, 4, 4, -1])
    v = values((7, 3), dtype)
    assert_compiles_like_eager(lambda x, i, v: x.index_put((i,), v, accumulate=True), x, i, v)
    assert aten.index_put.default in aten_ops


def test_index_put_non_adjacent_and_setitem(aten_ops):
    x = torch.randn(3, 6, 5, 7)
    i = torch.tensor([0, -1, 2])
    j = torch.tensor([[6], [-7]])
    v = torch.randn(2, 3, 3, 5)
    assert_compiles_like_eager(lambda x, i, j, v: aten.index_put(x, [None, i, None, j], v), x, i, j, v)
    assert_compiles_like_eager(
        lambda x, i, j, v: aten.index_put(x, [None, i, None, j], v[:1, :, :1], True), x, i, j, v
    )

    def setitem(x, i, v):
        y = x.clone()
        y[:, i] = v
        return y

    assert_compiles_like_eager(setitem, x, i, torch.randn(5, 7))
    assert aten.index_put.default in aten_ops


def test_index_put_grad(aten_ops):
    x = torch.randn(6, 4)
    i = torch.tensor([0, -1, 3])
    assert_compiles_like_eager(lambda x, i, v: x.index_put((i,), v * 3).sin(), x, i, torch.randn(3, 4), grad=True)
    assert aten.index_put.default in aten_ops


def test_unsafe_index_put():
    x = torch.randn(5, 6)
    i = torch.tensor([0, -1, 0])
    v = torch.randn(3, 6)
    assert_rule_like_eager(
        lambda x, i, v: aten._unsafe_index_put(x, [i], v, True), x, i, v, op=aten._unsafe_index_put.default
    )


# --- torch.gather / take_along_dim --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gather(aten_ops, dtype, dim):
    x = values((5, 6, 7), dtype)
    shape = [4, 3, 2]  # smaller than x in every dim, as torch allows
    shape[dim] = 9
    index = torch.randint(0, x.shape[dim], shape)
    assert_compiles_like_eager(lambda x, index: torch.gather(x, dim, index), x, index)
    assert aten.gather.default in aten_ops


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_gather_grad(aten_ops, dtype):
    x = values((5, 6), dtype)
    index = torch.randint(0, 6, (4, 10))  # many duplicates: the backward's scatter_add accumulates
    assert_compiles_like_eager(lambda x, index: torch.gather(x, 1, index), x, index, grad=True)
    assert {aten.gather.default, aten.scatter_add.default} <= aten_ops


def test_gather_0d():
    assert_rule_like_eager(
        lambda x, index: torch.gather(x, 0, index), torch.tensor(3.0), torch.tensor(0), op=aten.gather.default
    )


def test_gather_negative_rule():
    """Eager torch refuses negative gather indices; the rule wraps them (checked against wrapped indices)."""
    x = torch.randn(4, 5)
    index = torch.tensor([[-1, 0, -4], [2, -2, 1]])
    gm = make_fx(lambda x, index: torch.gather(x, 0, index), tracing_mode="fake")(x, index)
    (actual,) = driver.compile_graph(gm, [x, index], Options(), "test_indexing")([x, index])
    torch.testing.assert_close(actual, torch.gather(x, 0, index % 4))


def test_take_along_dim(aten_ops):
    x = torch.randn(4, 5, 6)
    index = torch.randint(0, 5, (4, 3, 1))
    assert_compiles_like_eager(lambda x, index: torch.take_along_dim(x, index, dim=1), x, index)
    assert_compiles_like_eager(lambda x, index: torch.take_along_dim(x, index), x, torch.randint(0, 120, (7, 2)))
    # take_along_dim is CompositeImplicitAutograd: it always reaches us as (expand +) gather
    assert aten.gather.default in aten_ops


# --- torch.scatter family -----------------------------------------------------------------------------------


def unique_index(size: int, shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """Indices with no duplicates along ``dim`` (torch leaves duplicate scatter targets unspecified)."""
    keys = torch.rand(*shape[:dim], size, *shape[dim + 1 :])
    return keys.argsort(dim=dim).narrow(dim, 0, shape[dim])


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
@pytest.mark.parametrize("dim", [0, -1])
def test_scatter_src(aten_ops, dtype, dim):
    x = values((5, 6), dtype)
    index = unique_index(x.shape[dim], (3, 4), dim % 2)
    src = values((4, 5), dtype)  # larger than index: only src[:3, :4] is used
    assert_compiles_like_eager(lambda x, index, src: torch.scatter(x, dim, index, src), x, index, src)
    assert aten.scatter.src in aten_ops


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
def test_scatter_value(aten_ops, dtype):
    x = values((5, 6), dtype)
    index = torch.randint(0, 6, (3, 8))  # duplicates write the same value: well defined
    assert_compiles_like_eager(lambda x, index: torch.scatter(x, 1, index, 2.0), x, index)
    assert aten.scatter.value in aten_ops


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
def test_scatter_add(aten_ops, dtype):
    x = values((5, 6, 2), dtype)
    index = torch.randint(0, 5, (7, 4, 2))  # duplicates accumulate
    src = values((7, 6, 2), dtype)
    assert_compiles_like_eager(lambda x, index, src: torch.scatter_add(x, 0, index, src), x, index, src)
    assert aten.scatter_add.default in aten_ops


@pytest.mark.filterwarnings("ignore:The reduce argument of torch.scatter")
@pytest.mark.parametrize("reduce", ["add", "multiply"])
def test_scatter_legacy_reduce(aten_ops, reduce):
    x = torch.randn(5, 6)
    index = torch.randint(0, 5, (7, 6))
    src = torch.rand(7, 6) + 0.5
    assert_compiles_like_eager(lambda x, index, src: torch.scatter(x, 0, index, src, reduce=reduce), x, index, src)
    assert_compiles_like_eager(lambda x, index: torch.scatter(x, 0, index, 1.5, reduce=reduce), x, index)
    assert {aten.scatter.reduce, aten.scatter.value_reduce} <= aten_ops


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("reduce", ["sum", "prod", "amax", "amin", "mean"])
def test_scatter_reduce(aten_ops, dtype, include_self, reduce):
    x = values((5, 4), dtype)
    index = torch.randint(0, 5, (8, 3))  # duplicates, and some rows never targeted
    src = values((8, 4), dtype)
    if reduce == "prod":
        x = (torch.rand(5, 4) + 0.5).to(dtype) if dtype.is_floating_point else torch.randint(-3, 4, (5, 4))
        src = (torch.rand(8, 4) + 0.5).to(dtype) if dtype.is_floating_point else torch.randint(-3, 4, (8, 4))

    def fn(x, index, src):
        return torch.scatter_reduce(x, 0, index, src, reduce, include_self=include_self)

    tolerance = dict(atol=5e-2, rtol=5e-2) if dtype is torch.bfloat16 else {}  # summation order differs
    assert_compiles_like_eager(fn, x, index, src, **tolerance)
    assert aten.scatter_reduce.two in aten_ops


def test_scatter_reduce_grad(aten_ops):
    x = torch.randn(5, 4)
    index = torch.randint(0, 5, (8, 4))
    fn = lambda x, src, index: torch.scatter_reduce(x, 0, index, src, "sum", include_self=False)  # noqa: E731
    assert_compiles_like_eager(fn, x, torch.randn(8, 4), index, grad=True)
    assert aten.scatter_reduce.two in aten_ops


# --- index_select / embedding -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
def test_index_select(aten_ops, dtype):
    x = values((4, 5, 6), dtype)
    index = torch.tensor([4, 0, 0, 2])
    assert_compiles_like_eager(lambda x, index: torch.index_select(x, 1, index), x, index)
    assert aten.index.Tensor in aten_ops  # our decomposition table rewrites index_select to index


def test_index_select_grad(aten_ops):
    x = torch.randn(4, 5, 6)
    index = torch.tensor([5, 0, 0, 2, 5])
    assert_compiles_like_eager(lambda x, index: torch.index_select(x, -1, index), x, index, grad=True)
    assert aten.index_put.default in aten_ops


@pytest.mark.parametrize("dim", [0, 2, -2])
def test_index_select_rule(dim):
    x = torch.randn(4, 5, 6)
    index = torch.tensor([3, 0, 3])
    assert_rule_like_eager(lambda x, index: torch.index_select(x, dim, index), x, index, op=aten.index_select.default)
    assert_rule_like_eager(
        lambda x, index: torch.index_select(x, dim, index), x, torch.tensor(1), op=aten.index_select.default
    )


def test_index_select_0d():
    assert_rule_like_eager(
        lambda x, index: torch.index_select(x, 0, index), torch.tensor(2.5), torch.tensor([0]),
        op=aten.index_select.default,
    )


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding_module_grad(aten_ops, padding_idx):
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 4, padding_idx=padding_idx)
    tokens = torch.tensor([[1, 2, 1, 9], [3, 3, 3, 0]])  # repeated tokens: their gradients add up

    def fn(weight, tokens):
        return torch.nn.functional.embedding(tokens, weight, padding_idx=padding_idx)

    assert_compiles_like_eager(fn, embedding.weight.detach(), tokens, grad=True)
    assert {aten.index.Tensor, aten.index_put.default} <= aten_ops

    eager_model = embedding
    compiled_model = torch.nn.Embedding(10, 4, padding_idx=padding_idx)
    compiled_model.load_state_dict(eager_model.state_dict())
    eager_model(tokens).square().sum().backward()
    compiled = torch.compile(compiled_model, backend="tpucompile", fullgraph=True)
    compiled(tokens).square().sum().backward()
    torch.testing.assert_close(compiled_model.weight.grad, eager_model.weight.grad)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_embedding_rule(dtype):
    weight = values((10, 3), dtype)
    tokens = torch.tensor([[1, 2, 1], [9, 0, 9]])
    assert_rule_like_eager(
        lambda w, t: aten.embedding(w, t, 2), weight, tokens, op=aten.embedding.default
    )


# --- index_add / index_copy / index_fill --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
def test_index_add(aten_ops, dtype):
    x = values((4, 5, 3), dtype)
    index = torch.tensor([4, 0, 4, 1])
    source = values((4, 4, 3), dtype)
    assert_compiles_like_eager(lambda x, index, s: x.index_add(1, index, s, alpha=2), x, index, source)
    assert aten.index_put.default in aten_ops


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
@pytest.mark.parametrize("dim", [0, -1])
def test_index_add_rule(dtype, dim):
    x = values((4, 5), dtype)
    index = torch.tensor([3, 0, 3, 3, 1])
    source = values((5, 5), dtype)
    if dim == -1:
        index, source = index[:4], values((4, 4), dtype)
    assert_rule_like_eager(
        lambda x, index, s: x.index_add(dim, index, s, alpha=3), x, index, source, op=aten.index_add.default
    )


def test_index_copy_and_fill_rules():
    x = torch.randn(4, 5)
    index = torch.tensor([4, 0, 2])
    assert_rule_like_eager(
        lambda x, index, s: x.index_copy(1, index, s), x, index, torch.randn(4, 3), op=aten.index_copy.default
    )
    assert_rule_like_eager(lambda x, index: x.index_fill(1, index, -2.0), x, index, op=aten.index_fill.int_Scalar)
    assert_rule_like_eager(
        lambda x, index, v: x.index_fill(1, index[:2], v), x, index, torch.tensor(7.0), op=aten.index_fill.int_Tensor
    )


# --- slice_scatter / select_scatter -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
@pytest.mark.parametrize(
    ("dim", "start", "end", "step"), [(1, 1, 5, 2), (0, None, None, 1), (-1, -4, None, 3), (1, 2, 3, 1), (1, 3, 3, 1)]
)
def test_slice_scatter(aten_ops, dtype, dim, start, end, step):
    x = values((4, 6, 7), dtype)
    src = torch.empty_like(x)[(slice(None),) * (dim % 3) + (slice(start, end, step),)]
    src = values(tuple(src.shape), dtype)
    fn = lambda x, src: torch.slice_scatter(x, src, dim, start, end, step)  # noqa: E731
    assert_compiles_like_eager(fn, x, src)
    assert aten.slice_scatter.default in aten_ops


def test_slice_grad(aten_ops):
    x = torch.randn(4, 9)
    assert_compiles_like_eager(lambda x: x[:, 1:8:3] * 2, x, grad=True)
    assert aten.slice_scatter.default in aten_ops


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
@pytest.mark.parametrize(("dim", "index"), [(0, 2), (1, -1), (-1, 0)])
def test_select_scatter_rule(dtype, dim, index):
    x = values((4, 5, 6), dtype)
    src = values(tuple(x.select(dim, index).shape), dtype)
    assert_rule_like_eager(
        lambda x, src: torch.select_scatter(x, src, dim, index), x, src, op=aten.select_scatter.default
    )


# --- masked_fill --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
def test_masked_fill_rules(dtype):
    x = values((4, 5), dtype)
    mask = torch.rand(5) > 0.5  # broadcasts over the rows
    assert_rule_like_eager(lambda x, m: x.masked_fill(m, -3), x, mask, op=aten.masked_fill.Scalar)
    value = torch.tensor(7, dtype=dtype)
    assert_rule_like_eager(lambda x, m, v: x.masked_fill(m, v), x, mask, value, op=aten.masked_fill.Tensor)


def test_masked_fill_compiled(aten_ops):
    x = torch.randn(4, 5)
    assert_compiles_like_eager(lambda x, m: x.masked_fill(m, float("-inf")).softmax(-1), x, torch.rand(4, 5) > 0.3)


# --- index_put with a boolean mask --------------------------------------------------------------------------


@pytest.mark.parametrize("accumulate", [False, True])
def test_index_put_bool_mask(aten_ops, accumulate):
    """``x[mask] = v`` keeps a static shape: the i-th True row takes row i of ``v``, or the one broadcast row."""
    mask = torch.tensor([True, False, True, True, False])
    rows = torch.randn(3, 4)
    assert_compiles_like_eager(lambda x, m, v: torch.index_put(x, (m,), v, accumulate), torch.randn(5, 4), mask,
                               rows, grad=True)
    assert_compiles_like_eager(lambda x, m, v: torch.index_put(x, (m,), v, accumulate), torch.randn(5, 4), mask,
                               torch.randn(4))
    assert aten.index_put.default in aten_ops


def test_index_put_bool_mask_inner_dims():
    def put(x, m, v):
        x = x.clone()
        x[:, m] = v
        return x

    mask = torch.rand(3, 4) > 0.5
    assert_compiles_like_eager(put, torch.randn(2, 3, 4, 2), mask, torch.randn(2, int(mask.sum()), 2))
    assert_compiles_like_eager(put, torch.randn(2, 3, 4, 2), mask, torch.randn(2))


# --- index_reduce, put, masked_scatter, nonzero_static, narrow_copy, unbind_copy ------------------------------


@pytest.mark.parametrize("include_self", [True, False])
def test_index_reduce(aten_ops, include_self):
    x = torch.randn(4, 3)
    source = torch.randn(5, 3)
    source[2, 1] = float("nan")
    index = torch.tensor([0, 2, 0, 3, 2])  # duplicates; row 1 untouched

    def reduce_all(x, i, s):
        return tuple(
            (x.index_reduce(0, i, s, r, include_self=include_self),
             x.T.index_reduce(1, i, s.T, r, include_self=include_self))
            for r in ("prod", "mean", "amax", "amin")
        )

    assert_compiles_like_eager(reduce_all, x, index, source)
    assert aten.index_reduce.default in aten_ops


def test_index_reduce_int_mean_rounds_down_and_grad():
    x = torch.tensor([[1, -3], [4, 5], [0, 0]])
    source = torch.tensor([[-4, 7], [2, -2], [5, 5]])
    index = torch.tensor([0, 0, 2])
    assert_compiles_like_eager(
        lambda x, i, s: (x.index_reduce(0, i, s, "mean"), x.index_reduce(0, i, s, "mean", include_self=False)),
        x, index, source,
    )
    assert_compiles_like_eager(lambda x, s: x.index_reduce(0, index, s, "prod"), torch.randn(3, 2),
                               torch.randn(3, 2), grad=True)


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
def test_put(aten_ops, dtype):
    def put(x, i, j, s, t):
        return x.put(i, s), x.put(j, t, accumulate=True)

    x = values((3, 4), dtype)
    index, accumulated = torch.tensor([[0, -1], [5, 7]]), torch.tensor([0, -1, 5, 0])
    grad = dtype.is_floating_point
    assert_compiles_like_eager(put, x, index, accumulated, values((2, 2), dtype), values((4,), dtype), grad=grad)
    assert aten.put.default in aten_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_masked_scatter(aten_ops, dtype):
    mask = torch.rand(4, 5) > 0.5
    x = values((4, 5), dtype) if dtype is not torch.bool else torch.rand(4, 5) > 0.5
    source = values((6, 5), dtype) if dtype is not torch.bool else torch.rand(6, 5) > 0.5
    assert_compiles_like_eager(lambda x, m, s: x.masked_scatter(m, s), x, mask, source)
    assert aten.masked_scatter.default in aten_ops


def test_masked_scatter_broadcast_grad(aten_ops):
    mask = torch.rand(4, 5) > 0.5  # self (1, 5) broadcasts over the mask's rows
    assert_compiles_like_eager(lambda x, m, s: x.masked_scatter(m, s), torch.randn(1, 5), mask, torch.randn(30),
                               grad=True)
    assert aten.masked_scatter_backward.default in aten_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_nonzero_static(aten_ops, dtype):
    x = (torch.rand(3, 4) > 0.5).to(dtype)
    count = int(x.count_nonzero())

    def nonzero(x, scalar):
        sizes = (0, count - 1, count + 3)
        return (*(torch.nonzero_static(x, size=n, fill_value=-7) for n in sizes),
                torch.nonzero_static(scalar, size=2))

    assert_compiles_like_eager(nonzero, x, torch.tensor(1, dtype=dtype))
    assert aten.nonzero_static.default in aten_ops


def test_narrow_copy_and_unbind_copy(aten_ops):
    x = torch.randn(4, 5, 3)
    assert_compiles_like_eager(lambda x: (torch.narrow_copy(x, 1, -3, 2), torch.unbind_copy(x, -2)), x, grad=True)
    assert {aten.narrow_copy.default, aten.unbind_copy.int} <= aten_ops


def test_gather_empty_index_of_other_rank():
    index = torch.zeros(2, 0, dtype=torch.int64)  # torch checks ranks only for non-empty indices
    assert_compiles_like_eager(lambda x, i: torch.gather(x, 0, i), torch.randn(5), index)
