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
from torch.fx.experimental.proxy_tensor import make_fx

from tests.support import assert_compiles_like_eager
from tpucompile import driver
from tpucompile.config import Options
from tpucompile.errors import LoweringError
from tpucompile.lowering import jax_bridge, lower_graph
from tpucompile.lowering.context import mlir_context
from tpucompile.lowering.types import TensorSpec, spec_type

aten = torch.ops.aten
TOL = dict(atol=1e-4, rtol=1e-4)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    """Fixed draws, so that no test depends on how well conditioned a fresh random matrix happens to be, and
    singular/eigen vectors can be compared with eager's, signs included."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def spd(*batch: int, n: int = 4) -> torch.Tensor:
    a = randn(*batch, n, n, seed=52)
    return a @ a.mT + n * torch.eye(n)


def test_inverse_cholesky_solve_with_grad(aten_ops):
    a, b = spd(), randn(4, 3, seed=40)

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
        fn, a, randn(2, 3, 4, seed=41), randn(2, 4, seed=42), randn(3, 1, 4, 2, seed=43), randn(4, 2, seed=44), **TOL
    )


@pytest.mark.filterwarnings("ignore:torch.triangular_solve is deprecated")
def test_triangular_solves(aten_ops):
    lower = torch.linalg.cholesky(spd(2))
    upper = lower.mT.contiguous()
    b = randn(2, 4, 3, seed=45)

    def fn(lower, upper, b, br):
        return (
            torch.linalg.solve_triangular(lower, b, upper=False),
            torch.linalg.solve_triangular(upper, br, upper=True, left=False, unitriangular=True),
            torch.triangular_solve(b, upper, upper=True, transpose=True),
            torch.cholesky_solve(b, lower),
            torch.cholesky_inverse(upper[0], upper=True),
        )

    assert_compiles_like_eager(fn, lower, upper, b, randn(3, 4, seed=46), **TOL)
    assert {aten.linalg_solve_triangular.default, aten.triangular_solve.default} <= aten_ops
    assert {aten.cholesky_solve.default, aten.cholesky_inverse.default} <= aten_ops


def test_triangular_solve_ignores_other_triangle():
    full = randn(4, 4, seed=47) + 4 * torch.eye(4)  # the other triangle holds garbage the solve must not read
    assert_compiles_like_eager(
        lambda a, b: (torch.linalg.solve_triangular(a, b, upper=True), torch.linalg.cholesky_ex(a @ a.T, upper=True).L),
        full,
        randn(4, 2, seed=48),
        **TOL,
    )


def test_det_slogdet_with_grad(aten_ops):
    a = randn(2, 4, 4, seed=35)  # condition numbers 7 and 6

    def fn(a):
        # The backward solves with the forward's LU, which is of A^T for a contiguous A and of A otherwise.
        return torch.linalg.det(a), torch.linalg.slogdet(a.mT).logabsdet

    assert_compiles_like_eager(fn, a, grad=True, **TOL)
    assert_compiles_like_eager(lambda a: (torch.linalg.slogdet(a), torch.logdet(a @ a.mT)), a, **TOL)
    assert {aten._linalg_det.default, aten._linalg_slogdet.default} <= aten_ops


def test_float64():
    a, b = spd(2).double(), randn(2, 4, 3, seed=49).double()

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

    assert_compiles_like_eager(fn, randn(2, 4, 4, seed=35), randn(5, 3, seed=50), **TOL)
    assert {aten.linalg_lu_factor_ex.default, aten.linalg_lu.default, aten.lu_unpack.default} <= aten_ops


def test_lu_solve_adjoint_and_right():
    a = randn(2, 4, 4, seed=28)

    def fn(a, b):
        lu, pivots = torch.linalg.lu_factor_ex(a)[:2]
        return (
            torch.linalg.lu_solve(lu, pivots, b),
            torch.linalg.lu_solve(lu, pivots, b, adjoint=True),
            torch.linalg.lu_solve(lu, pivots, b.mT, left=False),
        )

    assert_compiles_like_eager(fn, a, randn(4, 3, seed=51), **TOL)


# --- decompositions -------------------------------------------------------------------------------------------


def test_svd_family_with_grad(aten_ops):
    # tall; wide enough that reference LAPACK would LQ-factor first (MKL and we do not); wide, batched.
    tall, wide, batch = randn(6, 4, seed=1), randn(2, 7, seed=2), randn(2, 3, 4, seed=3)

    def fn(tall, wide, batch):
        u, s, vh = torch.linalg.svd(tall)
        return (
            u, s, vh,
            torch.linalg.svd(wide, full_matrices=False),
            torch.linalg.svd(wide).Vh,
            torch.svd(batch),
            torch.linalg.svdvals(batch),
        )

    assert_compiles_like_eager(fn, tall, wide, batch, grad=True, **TOL)
    assert aten._linalg_svd.default in aten_ops


def test_eigh_with_grad(aten_ops):
    small, large = randn(2, 4, 4, seed=4), randn(27, 27, seed=5)  # ssteqr order; divide-and-conquer order

    def fn(small, large):
        sym = small + small.mT
        return (
            torch.linalg.eigh(sym),
            torch.linalg.eigh(small, UPLO="U"),
            torch.linalg.eigvalsh(small),
            torch.linalg.eigh(large).eigenvectors,
        )

    assert_compiles_like_eager(fn, small, large, grad=True, **TOL)
    assert aten._linalg_eigh.default in aten_ops


def test_pinv_rank_cond_nuclear_with_grad(aten_ops):
    a = randn(2, 5, 3, seed=6)
    singular = randn(4, 2, seed=7) @ randn(2, 4, seed=8)

    def fn(a, singular):
        return (
            torch.linalg.pinv(a),
            torch.linalg.pinv(singular, hermitian=True),
            torch.linalg.pinv(singular, atol=torch.tensor(0.5, dtype=torch.float64)),
            torch.linalg.matrix_rank(singular),
            torch.linalg.cond(a[0].mT @ a[0]),
            torch.linalg.matrix_norm(a, "nuc"),
        )

    assert_compiles_like_eager(fn, a, singular, grad=True, **TOL)
    assert {aten.linalg_pinv.atol_rtol_tensor, aten._linalg_svd.default} <= aten_ops


def test_qr_family_with_grad(aten_ops):
    a, w = randn(5, 3, seed=9), randn(2, 3, 5, seed=10)

    def fn(a, w):
        q, r = torch.linalg.qr(a)
        reflectors, tau = torch.geqrf(a)
        c = w[0].mT
        return (
            q, r,
            torch.linalg.qr(w, mode="complete"),
            torch.linalg.qr(a, mode="r").R,
            reflectors, tau,
            torch.linalg.householder_product(reflectors, tau),
            torch.ormqr(reflectors, tau, c),
            torch.ormqr(reflectors, tau, c.mT, left=False, transpose=True),
        )

    assert_compiles_like_eager(fn, a, w, **TOL)
    assert_compiles_like_eager(lambda a: torch.linalg.qr(a), a, grad=True, **TOL)
    assert {aten.linalg_qr.default, aten.geqrf.default, aten.linalg_householder_product.default,
            aten.ormqr.default} <= aten_ops


def test_ldl_factor_and_solve_with_pivoting(aten_ops):
    indefinite = torch.tensor([[0.0, 2.0, 1.0, 0.5], [2.0, 0.1, 3.0, 1.0], [1.0, 3.0, -1.0, 2.0], [0.5, 1.0, 2.0, 4.0]])
    sym = randn(2, 5, 5, seed=11)
    sym = sym + sym.mT

    def fn(indefinite, sym, b):
        factors = torch.linalg.ldl_factor_ex(torch.stack([indefinite, indefinite.flip(0, 1)]))
        ld, pivots = torch.linalg.ldl_factor(sym)
        return factors, ld, pivots, torch.linalg.ldl_solve(ld, pivots, b)

    eager = torch.linalg.ldl_factor(indefinite).pivots
    assert (eager < 0).any(), "the test matrix must need a 2x2 pivot block"
    assert_compiles_like_eager(fn, indefinite, sym, randn(5, 2, seed=12), **TOL)
    assert {aten.linalg_ldl_factor_ex.default, aten.linalg_ldl_solve.default} <= aten_ops


def test_matrix_exp_with_grad(aten_ops):
    assert_compiles_like_eager(torch.linalg.matrix_exp, randn(2, 4, 4, seed=13) / 2, grad=True, **TOL)
    assert aten.linalg_matrix_exp.default in aten_ops


def test_decompositions_of_matrices_without_entries():
    def fn(rows, cols, batch, square):
        return (
            torch.linalg.svd(rows),  # a complete Vh of a matrix without rows is the identity
            torch.linalg.svd(cols),  # and so is a complete U of one without columns
            torch.svd(batch, some=False),
            torch.linalg.qr(cols, mode="complete"),
            torch.linalg.eigh(square),
            torch.linalg.solve(square, rows),
            torch.linalg.cholesky_ex(square),
            torch.linalg.ldl_factor_ex(square),
            torch.linalg.pinv(batch),
        )

    assert_compiles_like_eager(fn, torch.zeros(0, 3), torch.zeros(3, 0), torch.zeros(2, 0, 3), torch.zeros(0, 0))


# --- products and distances ----------------------------------------------------------------------------------


def test_distances_with_grad(aten_ops):
    x1, x2 = randn(2, 4, 3, seed=14), randn(5, 3, seed=15)

    def fn(x1, x2):
        return (
            torch.cdist(x1, x2),
            torch.cdist(x1, x2, p=1),
            torch.cdist(x1, x2, p=0.5),
            torch.cdist(x1, x2, p=3),
            torch.cdist(x1, x2, p=float("inf")),
            torch.cdist(x1, x2, compute_mode="use_mm_for_euclid_dist"),
            torch.nn.functional.pdist(x2),
            torch.nn.functional.pdist(x2, p=1.5),
            torch.dist(x1, x2[:4]),
            torch.dist(x1[0], x2[1:], p=3),
        )

    assert_compiles_like_eager(fn, x1, x2, grad=True, **TOL)
    assert {aten._cdist_forward.default, aten._cdist_backward.default, aten._pdist_forward.default,
            aten._pdist_backward.default} <= aten_ops


def test_addbmm_and_bilinear_with_grad(aten_ops):
    def fn(bias, b1, b2, x1, x2, weight, wbias):
        return (
            torch.addbmm(bias, b1, b2, beta=0.5, alpha=2),
            torch.nn.functional.bilinear(x1, x2, weight, wbias),
        )

    inputs = (randn(3, 4, seed=16), randn(2, 3, 5, seed=17), randn(2, 5, 4, seed=18), randn(6, 3, seed=19),
              randn(6, 2, seed=20), randn(4, 3, 2, seed=21), randn(4, seed=22))
    assert_compiles_like_eager(fn, *inputs, grad=True, **TOL)
    assert {aten.addbmm.default, aten._trilinear.default} <= aten_ops


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
