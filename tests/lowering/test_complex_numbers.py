"""Complex64 and complex128 values end to end: inputs and outputs across the torch/PJRT exchange (lazy
conjugate and negative bits included), constants, parts and pairs, pointwise and transcendental ops,
reductions, products, indexing and views, and gradients in PyTorch's conjugate-Wirtinger convention."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.support import assert_compiles_like_eager, compile_fn
from tpucompile.errors import UnsupportedOpError

COMPLEX = [torch.complex64, torch.complex128]


def _complex(dtype, *shape, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=dtype, generator=generator)


def _tolerance(dtype):
    return {"atol": 2e-5, "rtol": 2e-5} if dtype is torch.complex64 else {"atol": 1e-10, "rtol": 1e-10}


@pytest.mark.parametrize("dtype", COMPLEX, ids=str)
def test_arithmetic_with_complex_numbers_and_real_tensors(dtype):
    z, w, r = _complex(dtype, 3, 4), _complex(dtype, 3, 4, seed=1), torch.randn(3, 4)
    assert_compiles_like_eager(lambda z, w, r: (z * w - 2j, z / (w + 0.5), z + r, r * 1j - z, -z, z * 3, z ** 2),
                               z, w, r, **_tolerance(dtype))


@pytest.mark.parametrize("dtype", COMPLEX, ids=str)
def test_transcendental_functions(dtype):
    z = _complex(dtype, 5, 6)
    functions = (torch.exp, torch.log, torch.sqrt, torch.sin, torch.cos, torch.tan, torch.tanh, torch.sinh,
                 torch.cosh, torch.reciprocal, torch.rsqrt, torch.sigmoid, torch.log1p, torch.expm1)
    assert_compiles_like_eager(lambda z: [f(z) for f in functions], z, atol=1e-4, rtol=1e-4)
    assert_compiles_like_eager(lambda z, w: (torch.pow(z, w), z ** 0.5), z, _complex(dtype, 5, 6, seed=1),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", COMPLEX, ids=str)
def test_parts_pairs_and_the_ops_with_a_complex_meaning(dtype):
    z = _complex(dtype, 4, 5)
    part = dtype.to_real()
    assert_compiles_like_eager(
        lambda z: (z.real * 2, z.imag + 1, z.conj() * 1, torch.conj_physical(z), z.abs(), z.angle(), z.sgn(),
                   torch.view_as_real(z), torch.view_as_real(z.conj().resolve_conj()), z == z.conj(), torch.isnan(z)),
        z, **_tolerance(dtype))
    a, b = torch.randn(4, 5, dtype=part), torch.randn(5, dtype=part)
    assert_compiles_like_eager(lambda a, b: (torch.complex(a, b), torch.polar(a.abs(), b),
                                             torch.view_as_complex(torch.stack([a, a * 2], -1))),
                               a, b, **_tolerance(dtype))


def test_real_angles_and_signs_keep_their_real_meaning():
    x = torch.tensor([-2.0, -0.0, 0.0, 3.0, float("nan"), float("-inf")])
    assert_compiles_like_eager(lambda x: (x.angle(), x.sgn()), x)


def test_conversions_between_real_and_complex():
    z, r = _complex(torch.complex64, 3, 4), torch.randn(3, 4, dtype=torch.bfloat16)
    assert_compiles_like_eager(
        lambda z, r, i: (z.to(torch.complex128), r.to(torch.complex64), i.to(torch.complex64), z.to(torch.float64)),
        z, r, torch.arange(12).reshape(3, 4))


def test_views_between_complex_and_real_dtypes_reinterpret_the_bits():
    z, r = _complex(torch.complex64, 3, 4), torch.randn(3, 4)
    assert_compiles_like_eager(lambda z, r: (z.view(torch.float32), r.view(torch.complex64), z.view(torch.int32),
                                             z.view(torch.float64), r.view(torch.complex128)), z, r)


@pytest.mark.parametrize("dtype", COMPLEX, ids=str)
def test_reductions_products_and_indexing(dtype):
    z, w = _complex(dtype, 6, 4), _complex(dtype, 4, 3, seed=1)
    index = torch.tensor([0, 5, 2])
    assert_compiles_like_eager(
        lambda z, w: (z.sum(0), z.mean(1), z.prod(1), z @ w, torch.einsum("ij,jk->ik", z, w),
                      torch.cat([z, z.conj()], 0)[2:9:3], z[index], z.t().reshape(2, 12), z.flip(0), z.cumsum(0)),
        z, w, **_tolerance(dtype))


def test_lazily_conjugated_and_negated_inputs_pass_their_values():
    """A conjugate view and a negative view carry their bit beside shared memory; the values a program sees
    must be the ones the tensors show."""
    z = _complex(torch.complex64, 3, 4)
    compiled = compile_fn(lambda a, b: a * 1 + b * 2)
    expected = z.conj() * 1 + z.conj().imag.neg() * 2
    torch.testing.assert_close(compiled(z.conj(), z.conj().imag), z.conj() + z.conj().imag * 2)
    torch.testing.assert_close(compiled(z.conj(), torch._neg_view(z.conj().imag)), expected)


def test_complex_constants_in_the_graph():
    table = torch.tensor([1 + 2j, 3 - 1j, 0.5j, 2], dtype=torch.complex64)
    assert_compiles_like_eager(lambda z: z * table + torch.full((4,), 1 - 1j), _complex(torch.complex64, 3, 4))


@pytest.mark.parametrize("dtype", COMPLEX, ids=str)
def test_gradients_of_complex_inputs_follow_the_conjugate_wirtinger_convention(dtype):
    z, w = _complex(dtype, 4, 5), _complex(dtype, 5, 3, seed=1)
    assert_compiles_like_eager(lambda z, w: ((z @ w).exp() * z.conj().sum(), z.abs(), z.angle(), (z * w.sum(1)).real),
                               z, w, grad=True, atol=1e-4, rtol=1e-4)


def test_a_real_loss_of_complex_intermediates_trains():
    """Rotary embeddings written with ``polar`` and ``view_as_complex``, as Meta's Llama code does: a real
    loss, gradients for the real input and the angles."""

    def rotate(x, angles):
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        rotated = pairs * torch.polar(torch.ones_like(angles), angles)
        return torch.view_as_real(rotated).flatten(-2).sin()

    assert_compiles_like_eager(rotate, torch.randn(2, 8, 16), torch.randn(8, 8), grad=True)


def test_complex32_is_refused_by_name():
    with pytest.raises(Exception, match="complex32") as error:
        compile_fn(lambda x: x.chalf() * 2, fallback="error")(torch.randn(3))
    assert isinstance(error.value, UnsupportedOpError) or "UnsupportedOpError" in str(error.value)


def test_nan_and_infinity_in_either_part():
    nan, inf = float("nan"), float("inf")
    z = torch.complex(torch.tensor([1.0, nan, 1.0, inf, 0.0, 2.0]), torch.tensor([nan, 0.0, -inf, 1.0, 0.0, -3.0]))
    assert_compiles_like_eager(lambda z: (torch.isnan(z), torch.isinf(z), torch.isfinite(z), z.abs()), z)


# --- reductions and linear algebra whose complex meaning differs from the real one ---------------------------


def test_variances_and_norms_of_complex_values_are_real():
    z, w = _complex(torch.complex64, 5, 6), _complex(torch.complex64, 6, seed=1)
    assert_compiles_like_eager(
        lambda z, w: (z.var(0), z.std(1, correction=0), torch.var_mean(z, 1), torch.std_mean(z),
                      torch.linalg.vector_norm(z), torch.linalg.vector_norm(z, 1, dim=0),
                      torch.linalg.vector_norm(z, 3), torch.linalg.vector_norm(z, float("inf"), dim=1),
                      torch.linalg.vector_norm(z, 0), torch.dist(z, w), torch.dist(z, w, 3),
                      torch.dist(z.real, w), torch.dist(w, z.imag[0], 1),
                      torch.linalg.matrix_norm(z), torch.nn.functional.normalize(z)),
        z, w, atol=1e-5, rtol=1e-5)


def _well_conditioned(n, seed=0, batch=()):
    a = _complex(torch.complex64, *batch, n, n, seed=seed)
    return a @ a.mH + n * torch.eye(n, dtype=torch.complex64)


@pytest.mark.parametrize("upper", [False, True], ids=["lower", "upper"])
def test_cholesky_solves_use_the_conjugate_transpose(upper):
    a, b = _well_conditioned(4), _complex(torch.complex64, 4, 3, seed=2)
    factor = torch.linalg.cholesky(a, upper=upper)
    assert_compiles_like_eager(lambda f, b: (torch.cholesky_solve(b, f, upper=upper),
                                             torch.cholesky_inverse(f, upper=upper)), factor, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("left", [True, False], ids=["left", "right"])
@pytest.mark.parametrize("adjoint", [False, True], ids=["plain", "adjoint"])
def test_lu_solves_on_either_side_with_and_without_the_adjoint(left, adjoint):
    a, b = _well_conditioned(4, batch=(2,)), _complex(torch.complex64, 2, 4, 4, seed=3)
    lu, pivots = torch.linalg.lu_factor(a)
    assert_compiles_like_eager(
        lambda lu, b: torch.linalg.lu_solve(lu, pivots, b, left=left, adjoint=adjoint), lu, b, atol=1e-4, rtol=1e-4)
    assert_compiles_like_eager(lambda a, b: torch.linalg.solve(a, b, left=left), a, b, atol=1e-4, rtol=1e-4)


def test_pseudo_inverses_and_householder_reflectors_with_conjugate_transposes():
    """``geqrf`` as LAPACK's ``cgeqr2`` makes complex reflectors (a real diagonal of R, complex taus), and
    ``ormqr`` applies them and their conjugate transposes."""
    a, c = _complex(torch.complex64, 5, 3), _complex(torch.complex64, 5, 2, seed=1)
    assert_compiles_like_eager(lambda a: (torch.geqrf(a), torch.geqrf(a.mT.contiguous())), a, atol=1e-5, rtol=1e-5)
    reflectors, taus = torch.geqrf(a)
    assert_compiles_like_eager(
        lambda a, h, r, t, c: (torch.linalg.pinv(a), torch.linalg.pinv(h, hermitian=True),
                               torch.ormqr(r, t, c, transpose=True), torch.ormqr(r, t, c.mT, left=False)),
        a, _well_conditioned(4), reflectors, taus, c, atol=1e-4, rtol=1e-4)


def test_complex_factorisations_are_right_up_to_their_phases():
    """Singular vectors and eigenvectors of complex matrices are unique only up to a unit complex factor per
    vector: the values must equal eager's and the factors must rebuild the matrix."""
    a, h = _complex(torch.complex64, 4, 6), _well_conditioned(5)
    u, s, vh = compile_fn(lambda a: torch.linalg.svd(a, full_matrices=False))(a)
    torch.testing.assert_close(s, torch.linalg.svdvals(a), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(u @ torch.diag(s).to(a.dtype) @ vh, a, atol=1e-4, rtol=1e-4)
    values, vectors = compile_fn(torch.linalg.eigh)(h)
    torch.testing.assert_close(values, torch.linalg.eigvalsh(h), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(vectors @ torch.diag(values).to(h.dtype) @ vectors.mH, h, atol=1e-3, rtol=1e-4)


def test_real_only_factorisations_refuse_complex_values_and_fall_back():
    a = _well_conditioned(4)
    with pytest.raises(Exception, match=r"complex values are not lowered for this op .*aten\.linalg_ldl_factor_ex"):
        compile_fn(torch.linalg.ldl_factor, fallback="error")(a)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="runs aten.linalg_ldl_factor_ex.default in eager PyTorch"):
        factors, pivots = torch.compile(lambda a: torch.linalg.ldl_factor(a * 2), backend="tpucompile",
                                        options={"fallback": "eager"})(a)
    torch.testing.assert_close((factors, pivots), torch.linalg.ldl_factor(a * 2))


def _assert_same_eigenvectors(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Columns equal up to a factor of modulus one: ``geev`` gives each vector unit norm and a real largest
    component, which leaves its sign to the LAPACK build (MKL on AMD and OpenBLAS differ on some pairs)."""
    overlap = (expected.conj() * actual).sum(-2, keepdim=True)
    torch.testing.assert_close(actual, expected * (overlap / overlap.abs()), atol=1e-4, rtol=1e-4)


def test_general_eigendecompositions_match_lapack_on_the_cpu():
    """``linalg.eig`` through LAPACK's ``geev`` as eager calls it: the same eigenvalues in the same order and the
    same unit vectors (up to the sign the LAPACK build picks), for real and complex matrices, each pair solving
    A v = w v; gradients of a phase-free loss."""
    a, z = torch.randn(2, 5, 5, generator=torch.Generator().manual_seed(4)), _complex(torch.complex64, 4, 4)
    compiled = compile_fn(lambda a, z: (torch.linalg.eig(a), torch.linalg.eigvals(z), torch.linalg.eig(z)))
    (values_a, vectors_a), values_z_alone, (values_z, vectors_z) = compiled(a, z)
    for matrix, values, vectors in ((a, values_a, vectors_a), (z, values_z, vectors_z)):
        expected_values, expected_vectors = torch.linalg.eig(matrix)
        torch.testing.assert_close(values, expected_values, atol=1e-4, rtol=1e-4)
        _assert_same_eigenvectors(vectors, expected_vectors)
        torch.testing.assert_close(matrix.to(vectors.dtype) @ vectors, vectors * values.unsqueeze(-2), atol=1e-4,
                                   rtol=1e-4)
    torch.testing.assert_close(values_z_alone, torch.linalg.eigvals(z), atol=1e-4, rtol=1e-4)
    assert_compiles_like_eager(lambda a: torch.linalg.eigvals(a @ a.mT + a).abs(), a, grad=True, atol=1e-4,
                               rtol=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_general_eigendecompositions_are_refused_for_a_tpu_by_name(tmp_path):
    """XLA has no ``geev`` on a TPU: compiling for one refuses the op by name and line, or with the default
    fallback runs it in eager PyTorch with a warning."""
    options = {"targets": ["tpu:v5e:1x1"], "cache_dir": str(tmp_path)}
    x = torch.randn(4, 4, device="meta")
    with pytest.raises(Exception, match=r"XLA has no lowering of this op for tpu: aten\.linalg_eig\.default"):
        torch.compile(lambda x: torch.linalg.eigvals(x * 2).abs(), backend="tpucompile",
                      options={**options, "fallback": "error"})(x)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="runs aten.linalg_eig.default in eager PyTorch"):
        out = torch.compile(lambda x: torch.linalg.eigvals(x * 2).abs(), backend="tpucompile",
                            options={**options, "fallback": "eager"})(x)
    assert out.shape == (4,) and out.dtype == torch.float32


def test_complex_parameters_train_with_a_compiled_optimiser_step():
    """AdamW views complex parameters and their state as real pairs (``view_as_real``) inside its step: the
    compiled model and the compiled step against eager, two steps."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8).to(torch.complex64), torch.nn.Linear(8, 1).to(torch.complex64))
    twin = copy.deepcopy(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin)]
    forward = compile_fn(lambda x: twin(x).abs().pow(2).mean())
    step = torch.compile(optimizers[1].step, backend="tpucompile", options={"fallback": "error"})
    for _ in range(2):
        x = _complex(torch.complex64, 4, 8, seed=_)
        expected, got = model(x).abs().pow(2).mean(), forward(x)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        for optimizer, loss in zip(optimizers, (expected, got), strict=True):
            optimizer.zero_grad()
            loss.backward()
        optimizers[0].step()
        step()
        for p, q in zip(twin.parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)
