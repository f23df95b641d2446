"""Matrix products through the host BLAS: which dots the CPU rewrite takes, that the kernel computes them as
XLA does for every layout it accepts, and that what it leaves alone stays an XLA dot."""

from __future__ import annotations

import copy
import dataclasses
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.fresh_process import run_json
from tests.support import assert_compiles_like_eager
from tpucompile.runtime import compile_module, get_target, optimized_hlo
from tpucompile.runtime.host_kernels import kernel_choice
from tpucompile.runtime.host_kernels.library import TARGET_NAME, kernels
from tpucompile.runtime.transfer import to_buffer, to_tensor

RNG = np.random.default_rng(0)


@pytest.fixture(scope="module")
def targets():
    target = get_target("cpu")
    assert target.host_blas is not None, (
        "the host BLAS kernels did not build or bind on this machine (they need a C compiler, $CC or cc, and "
        "torch's sgemm_; the reason is logged at INFO by logger 'tpucompile')")
    return target, dataclasses.replace(target, host_blas=None)


def _module(fn, *shapes_and_dtypes) -> str:
    avals = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes_and_dtypes]
    with jax.enable_x64(True):  # f64 operands stay f64
        return jax.jit(fn).lower(*avals).as_text()


def _run(module, target, arrays):
    loaded = compile_module(module, target)
    buffers = [to_buffer(torch.from_numpy(np.ascontiguousarray(a)), target.device) for a in arrays]
    return [to_tensor(r).numpy() for r in loaded.execute(buffers)]


def _calls(module_text: str) -> int:
    return module_text.count(TARGET_NAME)


def _with_dtypes(target, dtypes):
    """``target`` with host kernels for ``dtypes`` only, as on a BLAS that lacks the others."""
    kernels = copy.copy(target.host_blas)
    kernels.dtypes = frozenset(dtypes)
    return dataclasses.replace(target, host_blas=kernels)


F32, F64 = np.float32, np.float64

# (name, function, operand shapes, dtype, products the rewrite takes)
CASES = [
    ("mm", lambda a, b: a @ b, [(6, 5), (5, 7)], F32, 1),
    ("x @ w.T (Linear)", lambda a, w: a @ w.T, [(6, 5), (7, 5)], F32, 1),
    ("a.T @ b (weight gradient)", lambda a, b: a.T @ b, [(5, 6), (5, 7)], F32, 1),
    ("a.T @ b.T", lambda a, b: a.T @ b.T, [(5, 6), (7, 5)], F32, 1),
    ("bmm", lambda a, b: a @ b, [(3, 6, 5), (3, 5, 7)], F32, 1),
    ("two batch dims", lambda a, b: jnp.einsum("xyik,xykj->xyij", a, b), [(2, 3, 4, 5), (2, 3, 5, 6)], F32, 1),
    ("attention scores q @ k.T", lambda q, k: jnp.einsum("bhqd,bhkd->bhqk", q, k), [(2, 3, 4, 8), (2, 3, 5, 8)],
     F32, 1),
    ("several free dims", lambda a, w: jnp.einsum("btc,nc->btn", a, w), [(2, 3, 5), (7, 5)], F32, 1),
    ("matrix-vector", lambda a, v: a @ v, [(6, 5), (5,)], F32, 1),
    ("vector-matrix", lambda v, a: v @ a, [(6,), (6, 5)], F32, 1),
    ("inner product", lambda u, v: u @ v, [(6,), (6,)], F32, 1),
    ("f64", lambda a, b: a @ b, [(6, 5), (5, 7)], F64, 1),
    ("k = 1 outer product", lambda a, b: a @ b, [(6, 1), (1, 7)], F32, 1),
    # left to XLA: the kernel would need data moved
    ("batch dim not leading", lambda a, b: jnp.einsum("ibk,bkj->bij", a, b), [(6, 3, 5), (3, 5, 7)], F32, 0),
    ("two contracting dims", lambda a, b: jnp.einsum("ikl,klj->ij", a, b), [(6, 4, 5), (4, 5, 7)], F32, 0),
    ("contracting dim in the middle", lambda a, b: jnp.einsum("xky,kj->xyj", a, b), [(2, 5, 3), (5, 7)], F32, 0),
    ("integers", lambda a, b: a @ b, [(6, 5), (5, 7)], np.int32, 0),
    ("zero-size", lambda a, b: a @ b, [(0, 5), (5, 7)], F32, 0),
]


@pytest.mark.parametrize("name, fn, shapes, dtype, expected", CASES, ids=[c[0] for c in CASES])
def test_rewritten_products_equal_xla_dots(targets, name, fn, shapes, dtype, expected):
    with_blas, without = targets
    module = _module(fn, *[(s, dtype) for s in shapes])
    rewritten = kernel_choice.apply(module, with_blas, None)
    text = rewritten if isinstance(rewritten, str) else _as_text(rewritten)
    assert _calls(text) == expected, text
    if not expected:
        assert rewritten is module
    arrays = [(RNG.standard_normal(s) * 3).astype(dtype) for s in shapes]
    got = _run(module, with_blas, arrays)[0]
    want = _run(module, without, arrays)[0]
    reference = fn(*[a.astype(np.float64) for a in arrays]) if dtype != np.int32 else fn(*arrays)
    tolerance = {F32: 1e-5, F64: 1e-12}.get(dtype, 0)
    np.testing.assert_allclose(got, np.asarray(reference), rtol=tolerance, atol=tolerance * 10)
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance * 10)


def test_bf16_products_accumulate_in_f32(targets):
    """MKL has a bf16 x bf16 -> f32 product; with a BLAS without one, the dot must stay with XLA."""
    import ml_dtypes

    with_blas, _ = targets

    def product(a, b):
        return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    module = _module(product, ((16, 64), jnp.bfloat16), ((8, 64), jnp.bfloat16))
    without_bf16 = _with_dtypes(with_blas, with_blas.host_blas.dtypes - {"bf16"})
    assert _calls(_as_text(kernel_choice.apply(module, without_bf16, None))) == 0
    has_bf16 = "bf16" in with_blas.host_blas.dtypes
    assert _calls(_as_text(kernel_choice.apply(module, with_blas, None))) == int(has_bf16)
    a = RNG.standard_normal((16, 64)).astype(ml_dtypes.bfloat16)
    b = RNG.standard_normal((8, 64)).astype(ml_dtypes.bfloat16)
    loaded = compile_module(module, with_blas)
    got = np.asarray(loaded.execute([jax.device_put(a, with_blas.device), jax.device_put(b, with_blas.device)])[0])
    exact = a.astype(np.float64) @ b.astype(np.float64).T  # bf16 inputs are exact in f64; f32 sums round little
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-4)


def test_bf16_results_are_the_f32_product_rounded_once(targets):
    """A product written in bf16 (the form bf16 matrix products lower to) calls the same f32-accumulating
    kernel and rounds its result: bitwise the f32 product rounded to bf16."""
    import ml_dtypes

    with_blas, _ = targets
    if "bf16" not in with_blas.host_blas.dtypes:
        pytest.skip("this BLAS has no bf16 x bf16 -> f32 product")

    def product(a, b):
        return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)

    module = _module(product, ((16, 256), jnp.bfloat16), ((8, 256), jnp.bfloat16))
    rewritten = _as_text(kernel_choice.apply(module, with_blas, None))
    assert _calls(rewritten) == 1 and "stablehlo.convert" in rewritten, rewritten
    a = RNG.standard_normal((16, 256)).astype(ml_dtypes.bfloat16)
    b = RNG.standard_normal((8, 256)).astype(ml_dtypes.bfloat16)
    loaded = compile_module(module, with_blas)
    got = np.asarray(loaded.execute([jax.device_put(a, with_blas.device), jax.device_put(b, with_blas.device)])[0])
    assert got.dtype == ml_dtypes.bfloat16
    f32 = (a.astype(np.float64) @ b.astype(np.float64).T).astype(np.float32)
    # f32 sums in another order than f64's may round across a bf16 boundary: at most one bf16 step apart.
    np.testing.assert_allclose(got.astype(np.float32), f32, rtol=2 ** -7, atol=1e-6)
    assert (got.astype(np.float32) == f32.astype(ml_dtypes.bfloat16).astype(np.float32)).mean() > 0.95


def test_linear_layers_read_weights_without_copying_them(targets):
    """``x @ w.T`` must not materialise ``w.T``: the kernel's transpose flag reads ``w`` where it lies."""
    with_blas, _ = targets
    linear = lambda x, w: jnp.tanh(x @ w.T)  # noqa: E731
    # AOTAutograd's backward multiplies by permute(permute(w.T)): the whole chain is read through
    chained = lambda x, w: jnp.tanh(x @ jnp.transpose(jnp.transpose(w.T)))  # noqa: E731
    for fn, transposes in ((linear, 1), (chained, 3)):
        module = _module(fn, ((64, 256), F32), ((128, 256), F32))
        assert module.count("stablehlo.transpose") == transposes, module
        hlo = optimized_hlo(compile_module(module, with_blas))
        assert TARGET_NAME in hlo
        assert not re.search(r"= f32\[[0-9,]+\]\{[0-9,]+\} (transpose|copy)\(", hlo), hlo


def test_the_kernel_refuses_a_malformed_call_with_a_message(targets):
    """A call the kernel cannot serve (here: no transpose attributes) fails with XLA's error naming the
    kernel, never reads memory it was not given."""
    with_blas, _ = targets
    module = textwrap.dedent(f"""
        func.func @main(%a: tensor<1x2x3xf32>, %b: tensor<1x3x4xf32>) -> tensor<1x2x4xf32> {{
          %0 = stablehlo.custom_call @{TARGET_NAME}(%a, %b) {{api_version = 1 : i32, backend_config = "",
              mhlo.backend_config = {{}}}} : (tensor<1x2x3xf32>, tensor<1x3x4xf32>) -> tensor<1x2x4xf32>
          return %0 : tensor<1x2x4xf32>
        }}""")
    loaded = compile_module(module, with_blas)
    arrays = [torch.ones(1, 2, 3), torch.ones(1, 3, 4)]
    with pytest.raises(Exception, match=TARGET_NAME):
        to_tensor(loaded.execute([to_buffer(a, with_blas.device) for a in arrays])[0])


def test_compiled_models_match_eager_through_the_kernel(targets):
    """Linear layers, a batched product and their gradients, through torch.compile."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 8))
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="tpucompile", options={"host_kernels": "on"})
    x = torch.randn(16, 32, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    compiled(x).square().sum().backward()
    eager(x_eager).square().sum().backward()
    torch.testing.assert_close(x.grad, x_eager.grad, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)
    assert_compiles_like_eager(lambda a, b: torch.softmax(a @ b.transpose(-1, -2), -1) @ b,
                               torch.randn(2, 3, 7, 16), torch.randn(2, 3, 9, 16), grad=True, host_kernels="on")


def test_turning_the_kernels_off_changes_the_executable_key_not_the_results(tmp_path):
    """``TPUCOMPILE_HOST_BLAS=0`` compiles XLA's own dots, under other cache keys, with the same results."""
    script = textwrap.dedent("""
        import json, sys, torch
        from tpucompile import artifacts
        from tpucompile.runtime import get_target
        torch.manual_seed(0)
        f = torch.compile(lambda a, b: (a @ b).relu(), backend="tpucompile", options={"host_kernels": "on"})
        out = f(torch.randn(8, 16), torch.randn(16, 4))
        print(json.dumps({"host_blas": artifacts.environment(get_target())["host_blas"],
                          "out": out.tolist()}))
    """)
    on, off = (run_json(script, {"TPUCOMPILE_HOST_BLAS": value, "TPUCOMPILE_CACHE_DIR": str(tmp_path / "cache")})
               for value in ("1", "0"))
    assert on["host_blas"] == kernels().fingerprint and off["host_blas"] is None
    np.testing.assert_allclose(on["out"], off["out"], rtol=1e-5, atol=1e-5)


def _as_text(module) -> str:
    if isinstance(module, str):
        return module
    from jax.extend.mlir import ir
    from jax.interpreters import mlir as jax_mlir

    with jax_mlir.make_ir_context():
        return str(ir.Module.parse(module))


def test_products_run_the_blas_on_one_thread_and_restore_the_callers_setting(tmp_path):
    """Inside a program the BLAS runs on the calling thread alone (an OpenMP team would compete with XLA's pool
    for the cores), and the caller's own thread-local setting (torch's, the user's) is restored after each
    call. The kernel's calls of the thread-count setter are recorded against a stand-in that keeps a value per
    thread and returns the previous one, as MKL's does."""
    script = textwrap.dedent("""
        import ctypes, json, threading, torch
        from tpucompile.runtime.host_kernels.library import kernels
        library = kernels().library
        values, seen = {}, []
        @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)
        def recording_setter(count):
            thread = threading.get_ident()
            previous = values.get(thread, 0)
            values[thread] = count
            seen.append(count)
            return previous
        library.tpucompile_host_blas_threads(ctypes.cast(recording_setter, ctypes.c_void_p))
        f = torch.compile(lambda a, b, c: torch.tanh(a @ b) @ c, backend="tpucompile",
                          options={"host_kernels": "on"})
        for m in (8, 256):  # below and above the size at which the BLAS forks threads
            a, b, c = torch.randn(m, 256), torch.randn(256, 512) / 16, torch.randn(512, 128) / 16
            torch.testing.assert_close(f(a, b, c), torch.tanh(a @ b) @ c, atol=1e-4, rtol=1e-4)
        print(json.dumps({"main_thread_after": values.get(threading.main_thread().ident, 0),
                          "one_thread_set": 1 in seen, "calls": len(seen)}))
    """)
    result = run_json(script, {"TPUCOMPILE_CACHE_DIR": str(tmp_path / "cache")})
    assert result["one_thread_set"] and result["calls"] >= 4, result
    assert result["main_thread_after"] == 0, "the caller's thread-local BLAS setting was not restored"
