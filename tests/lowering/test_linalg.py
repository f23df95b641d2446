"""Linear algebra lowerings (native Cholesky/triangular solve, LU family through the jax bridge) against eager.

Each test compiles one function with several ops, to keep the compile count low, and checks with the
``aten_ops`` fixture that the ATen ops it is about reached the backend.
"""

from __future__ import annotations

import jax
import pytest
import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import func
from support import assert_compiles_like_eager
from torch.fx.experimental.proxy_tensor import make_fx

from tpucompile import backend, driver
from tpucompile.config import Options
from tpucompile.errors import LoweringError
from tpucompile.lowering import jax_bridge, lower_graph
from tpucompile.lowering.context import mlir_context
from tpucompile.lowering.types import TensorSpec, spec_type

aten = torch.ops.aten
TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture
def aten_ops(monkeypatch) -> set:
    """The ATen ops of every graph handed to the tpucompile backend during the test."""
    seen: set = set()
    original = backend.compile_graph

    def recording(gm, example_inputs, options, name):
        seen.update(n.target for n in gm.graph.nodes if n.op == "call_function")
        return original(gm, example_inputs, options, name)

    monkeypatch.setattr(backend, "compile_graph", recording)
    return seen


def spd(*batch: int, n: int = 4) -> torch.Tensor:
    a = torch.randn(*batch, n, n)
    return a @ a.mT + n * torch.eye(n)


def test_inverse_cholesky_solve_with_grad(aten_ops):
    a, b = spd(), torch.randn(4, 3)

    def fn(a, b):
        return torch.linalg.inv(a), torch.linalg.cholesky(a), torch.linalg.solve(a, b)

    assert_compiles_like_eager(fn, a, b, grad=True, **TOL)
    assert {aten.linalg_inv_ex.default, aten.linalg_cholesky_ex.default, aten._linalg_solve_ex.default} <= aten_ops
    assert aten.linalg_lu_solve.default in aten_ops  # the solve backward
    assert aten.linalg_solve_triangular.default in aten_ops  # the cholesky backward


def test_ex_variants_batched_with_info(aten_ops):
    a = spd(2, 3)
    singular = torch.tensor([[1.0, 2.0], [2.0, 4.0]])
    not_pd = torch.tensor([[1.0, 2.0], [2.0, 1.0]])

    def fn(a, s, n):
        return (
            torch.linalg.inv_ex(a),
            torch.linalg.cholesky_ex(a, upper=True),
            torch.linalg.inv_ex(s).info,
            torch.linalg.cholesky_ex(n).info,
            torch.linalg.cholesky_ex(s).info,
        )

    assert_compiles_like_eager(fn, a, singular, not_pd, **TOL)
    assert {aten.linalg_inv_ex.default, aten.linalg_cholesky_ex.default} <= aten_ops


def test_solve_variants():
    a = spd(2)

    def fn(a, b, v, c, d):
        return (
            torch.linalg.solve(a, v),  # a batch of vectors
            torch.linalg.solve(a, b, left=False),
            torch.linalg.solve(a, c),  # broadcast batch dims
            torch.linalg.solve(a[0].T, d),  # a non-contiguous A
        )

    assert_compiles_like_eager(
        fn, a, torch.randn(2, 3, 4), torch.randn(2, 4), torch.randn(3, 1, 4, 2), torch.randn(4, 2), **TOL
    )


@pytest.mark.filterwarnings("ignore:torch.triangular_solve is deprecated")
def test_triangular_solves(aten_ops):
    lower = torch.linalg.cholesky(spd(2))
    upper = lower.mT.contiguous()
    b = torch.randn(2, 4, 3)

    def fn(lower, upper, b, br):
        return (
            torch.linalg.solve_triangular(lower, b, upper=False),
            torch.linalg.solve_triangular(upper, br, upper=True, left=False, unitriangular=True),
            torch.triangular_solve(b, upper, upper=True, transpose=True),
            torch.cholesky_solve(b, lower),
            torch.cholesky_inverse(upper[0], upper=True),
        )

    assert_compiles_like_eager(fn, lower, upper, b, torch.randn(3, 4), **TOL)
    assert {aten.linalg_solve_triangular.default, aten.triangular_solve.default} <= aten_ops
    assert {aten.cholesky_solve.default, aten.cholesky_inverse.default} <= aten_ops


def test_triangular_solve_ignores_other_triangle():
    full = torch.randn(4, 4) + 4 * torch.eye(4)  # the other triangle holds garbage the solve must not read
    assert_compiles_like_eager(
        lambda a, b: (torch.linalg.solve_triangular(a, b, upper=True), torch.linalg.cholesky_ex(a @ a.T, upper=True).L),
        full,
        torch.randn(4, 2),
        **TOL,
    )


def test_det_slogdet_with_grad(aten_ops):
    a = torch.randn(2, 4, 4)

    def fn(a):
        # The backward solves with the forward's LU, which is of A^T for a contiguous A and of A otherwise.
        return torch.linalg.det(a), torch.linalg.slogdet(a.mT).logabsdet

    assert_compiles_like_eager(fn, a, grad=True, **TOL)
    assert_compiles_like_eager(lambda a: (torch.linalg.slogdet(a), torch.logdet(a @ a.mT)), a, **TOL)
    assert {aten._linalg_det.default, aten._linalg_slogdet.default} <= aten_ops


def test_float64():
    a, b = spd(2).double(), torch.randn(2, 4, 3, dtype=torch.float64)

    def fn(a, b):
        return torch.linalg.inv_ex(a).inverse, torch.linalg.solve_ex(a, b).result, torch.linalg.det(a)

    assert_compiles_like_eager(fn, a, b)


def test_det_of_singular_matrix():
    singular = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [4.0, 5.0, 6.0]])  # an exact zero pivot
    assert_compiles_like_eager(lambda a: (torch.linalg.det(a), torch.linalg.slogdet(a)), singular, **TOL)


def test_lu_family(aten_ops):
    def fn(a, w):
        lu, pivots = torch.linalg.lu_factor(a)
        return lu, pivots, torch.linalg.lu(w), torch.lu_unpack(lu, pivots), torch.linalg.lu_factor_ex(w).LU

    assert_compiles_like_eager(fn, torch.randn(2, 4, 4), torch.randn(5, 3), **TOL)
    assert {aten.linalg_lu_factor_ex.default, aten.linalg_lu.default, aten.lu_unpack.default} <= aten_ops


def test_lu_solve_adjoint_and_right():
    a = torch.randn(2, 4, 4)

    def fn(a, b):
        lu, pivots = torch.linalg.lu_factor_ex(a)[:2]
        return (
            torch.linalg.lu_solve(lu, pivots, b),
            torch.linalg.lu_solve(lu, pivots, b, adjoint=True),
            torch.linalg.lu_solve(lu, pivots, b.mT, left=False),
        )

    assert_compiles_like_eager(fn, a, torch.randn(4, 3), **TOL)


# --- the bridge itself ---------------------------------------------------------------------------------------


def test_bridge_splices_private_functions_once_and_deterministically():
    a = spd()
    gm = make_fx(lambda a, b: (aten.linalg_inv_ex(a)[0], aten.linalg_inv_ex(b)[0]), tracing_mode="fake")(a, a)
    x64_before = jax.config.jax_enable_x64
    first = lower_graph(gm).text(debug_info=False)
    lowerings = jax_bridge.lowerings_done()
    second = lower_graph(gm).text(debug_info=False)
    assert jax_bridge.lowerings_done() == lowerings, "the jax lowering was not memoised"
    assert first == second, "module text must not depend on when or how often it was lowered"
    assert jax.config.jax_enable_x64 == x64_before
    assert first.count("func.func public") == 1
    # main calls one spliced entry function twice: the two inverses of the same shape share it
    callee = first.split("call @")[1].split("(")[0]
    assert callee.startswith("jax_linalg_inv_ex_")
    assert first.count(f"call @{callee}(") == 2
    assert first.count(f"func.func private @{callee}(") == 1
    compiled = driver.compile_graph(gm, [a, a], Options(), "test_bridge")
    for result in compiled([a, a]):
        torch.testing.assert_close(result, torch.linalg.inv(a), **TOL)


def test_bridge_checks_result_types():
    import jax.numpy as jnp

    spec = TensorSpec((3,), torch.float32)
    with mlir_context(), ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            main = func.FuncOp("main", ir.FunctionType.get([spec_type(spec)], []))
            block = main.add_entry_block()
        with ir.InsertionPoint(block), pytest.raises(LoweringError, match="expected int64"):
            jax_bridge.call("test_cumsum", jnp.cumsum, [block.arguments[0]], [TensorSpec((3,), torch.int64)])


def test_bridge_lowers_for_the_target_platform():
    """jax emits platform custom calls (LAPACK on CPU, ``LuDecomposition`` on TPU); the module must carry
    those of the platform it is compiled for. Lowering for TPU needs no TPU."""
    gm = make_fx(lambda a: aten._linalg_det(a), tracing_mode="fake")(torch.randn(3, 3))
    with jax_bridge.target_platform("tpu"):
        tpu = lower_graph(gm).text(debug_info=False)
    with jax_bridge.target_platform("cpu"):
        cpu = lower_graph(gm).text(debug_info=False)
    assert "LuDecomposition" in tpu and "lapack" not in tpu
    assert "lapack_sgetrf" in cpu and tpu != cpu


def test_empty_matrices():
    def f(x):
        sign, logabsdet = torch.linalg.slogdet(x)
        return torch.linalg.det(x), sign, logabsdet, torch.linalg.inv(x), torch.linalg.inv_ex(x).info

    assert_compiles_like_eager(f, torch.zeros(0, 0))
    assert_compiles_like_eager(f, torch.zeros(3, 0, 0))
