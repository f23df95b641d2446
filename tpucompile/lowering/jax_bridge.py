"""The escape hatch for ops hard to write by hand: lower a jax function once and call it from the module being built.

Some ops (LU factorisations and the solves built on them, …) are far easier to take from ``jax.lax`` than to
write in StableHLO by hand. ``call`` lowers ``fn`` for the operands' concrete shapes and dtypes with
``jax.jit(fn).trace(...).lower(...)`` (memoised by op name, parameters, operand specs and platform), parses
the StableHLO text into *our* MLIR context, renames its functions to private symbols that cannot clash
(``@jax_<name>_<digest>`` for its ``main``, ``@jax_<name>_<digest>_<callee>`` for the rest), moves them into
the module that encloses the current insertion point, and emits a ``func.call``.

Rules need no handle on the module: it is found by walking up from the insertion point, so the graph lowering
needs no hook. Symbol names are a digest of the memo key, never a counter, so the same graph always gives the
same module text (the cache keys on it) and a second call with the same key in one module reuses the
functions already spliced in.

jax runs with 64-bit types only inside ``with jax.enable_x64(True):`` around the lowering; jax's global x64
flag, which belongs to the user's process, is never changed. What jax emits may hold custom calls of the
platform it lowers for (LAPACK on CPU), so it must be the platform the module is compiled for: the one set
by ``with target_platform(name):`` around the graph lowering, else jax's default backend.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import re
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence

import ml_dtypes
import numpy as np
import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import func

from tpucompile.errors import LoweringError
from tpucompile.lowering.types import NUMPY_DTYPES, TensorSpec, spec_of, spec_type, torch_dtype_of

_MEMO_SIZE = 512
_memo: collections.OrderedDict[_Key, str] = collections.OrderedDict()
_memo_lock = threading.Lock()
_lowerings = 0
_local = threading.local()


@dataclasses.dataclass(frozen=True)
class _Key:
    name: str
    params: Hashable
    operands: tuple[TensorSpec, ...]
    platform: str
    x64: bool = True

    def digest(self) -> str:
        text = f"{self.name}|{self.params!r}|{[str(s) for s in self.operands]}|{self.platform}"
        if not self.x64:
            text += "|x32"
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def call(
    name: str,
    fn: Callable[..., object],
    operands: Sequence[ir.Value],
    result_specs: Sequence[TensorSpec] | None,
    *,
    params: Hashable = (),
    platform: str | None = None,
    x64: bool = True,
) -> list[ir.Value]:
    """``fn(*operands)`` as a call to a private function lowered from jax; returns its results.

    ``name`` and ``params`` must determine ``fn`` completely (they key the memo). ``fn`` takes and returns
    jax arrays (a single array or a tuple); its results must have exactly ``result_specs`` (None: whatever
    it returns, for a caller that checks them itself). ``x64=False``
    lowers with jax's 32-bit default types, for functions that take no 64-bit operands and cannot be traced
    with 64-bit indices (Pallas kernels).
    """
    key = _Key(name, params, tuple(spec_of(v) for v in operands), platform or _default_platform(), x64)
    text = _lowered_text(key, fn)
    callee = _splice(key, text)
    got = [_spec_of_type(t) for t in callee.type.results]
    if result_specs is None:
        result_specs = got
    elif got != list(result_specs):
        raise LoweringError(
            f"jax lowering of {name} returned {', '.join(map(str, got))}, "
            f"expected {', '.join(map(str, result_specs))}"
        )
    op = func.CallOp([spec_type(s) for s in result_specs], ir.FlatSymbolRefAttr.get(callee.name.value), list(operands))
    return list(op.results)


@contextlib.contextmanager
def _thread_setting(name: str, value: object, default: object) -> Iterator[None]:
    """``name`` set to ``value`` in this thread's settings for the block, then back to what it was."""
    previous = getattr(_local, name, default)
    setattr(_local, name, value)
    try:
        yield
    finally:
        setattr(_local, name, previous)


def target_platform(platform: str | None) -> contextlib.AbstractContextManager[None]:
    """Lower jax functions for ``platform`` ("cpu", "cuda", "tpu"; None: jax's default) in this thread."""
    return _thread_setting("platform", platform, None)


def kernels_interpreted(interpret: bool) -> contextlib.AbstractContextManager[None]:
    """With ``interpret``, rules that call Pallas TPU kernels lower them in Pallas' interpret mode, for every
    platform (to check a kernel's values where no TPU is), in this thread."""
    return _thread_setting("interpret", interpret, False)


def interpreting_kernels() -> bool:
    """Whether Pallas TPU kernels are lowered in interpret mode here and now (``kernels_interpreted``)."""
    return getattr(_local, "interpret", False)


def holds_jax_lowerings(module: ir.Module) -> bool:
    """Whether ``module`` calls functions lowered from jax, whose text depends on the platform they were
    lowered for (a program without any is the same for every platform)."""
    return any(ir.SymbolTable.get_symbol_name(op).value.startswith("jax_")
               for op in module.body.operations if op.operation.name == "func.func")


def lowerings_done() -> int:
    """How many times jax has been asked to lower a function in this process (tests check the memo with it)."""
    return _lowerings


def current_platform() -> str:
    """The platform jax functions are lowered for here and now (rules whose jax function differs per
    platform choose with it)."""
    return _default_platform()


def _default_platform() -> str:
    platform = getattr(_local, "platform", None)
    if platform is not None:
        return platform
    import jax

    return jax.default_backend()


def _jax_dtype(dtype: torch.dtype) -> np.dtype:
    if dtype is torch.bfloat16:
        return np.dtype(ml_dtypes.bfloat16)
    return NUMPY_DTYPES[dtype]


def _lowered_text(key: _Key, fn: Callable[..., object]) -> str:
    with _memo_lock:
        text = _memo.get(key)
        if text is not None:
            _memo.move_to_end(key)
            return text
    text = _lower(key, fn)
    with _memo_lock:
        _memo[key] = text
        while len(_memo) > _MEMO_SIZE:
            _memo.popitem(last=False)
    return text


def _lower(key: _Key, fn: Callable[..., object]) -> str:
    global _lowerings
    import jax

    structs = [jax.ShapeDtypeStruct(s.shape, _jax_dtype(s.dtype)) for s in key.operands]
    try:
        with jax.enable_x64(key.x64):
            lowered = jax.jit(fn, keep_unused=True).trace(*structs).lower(lowering_platforms=(key.platform,))
            text = lowered.as_text()
    except Exception as error:
        raise LoweringError(f"jax could not lower {key.name} for {[str(s) for s in key.operands]}: {error}") from error
    _lowerings += 1
    return text


def _spec_of_type(type_: ir.Type) -> TensorSpec:
    ranked = ir.RankedTensorType(type_)
    return TensorSpec(tuple(ranked.shape), torch_dtype_of(ranked.element_type))


def enclosing_module() -> ir.Operation:
    """The ``builtin.module`` that holds the current insertion point."""
    op = ir.InsertionPoint.current.block.owner
    while op is not None and op.name != "builtin.module":
        op = op.parent
    if op is None:
        raise LoweringError("jax_bridge.call needs an insertion point inside a module")
    return op.operation


def _symbol(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def _splice(key: _Key, text: str) -> func.FuncOp:
    """Move the functions of ``text`` into the enclosing module (once per key) and return the entry one."""
    module = enclosing_module()
    table = ir.SymbolTable(module)
    entry = f"jax_{_symbol(key.name)}_{key.digest()}"
    if entry in table:
        return table[entry].operation.opview
    parsed = ir.Module.parse(text)
    functions = list(parsed.body.operations)
    for op in functions:
        if op.operation.name != "func.func":
            raise LoweringError(f"jax lowering of {key.name} holds a {op.operation.name}, not only functions")
    source = ir.SymbolTable(parsed.operation)
    renamed = {}
    for op in functions:
        old = ir.SymbolTable.get_symbol_name(op).value
        renamed[old] = entry if old == "main" else f"{entry}_{_symbol(old)}"
    if "main" not in renamed:
        raise LoweringError(f"jax lowering of {key.name} has no main function")
    for op in functions:
        old = ir.SymbolTable.get_symbol_name(op).value
        source.set_symbol_name(op, renamed[old])
        op.attributes["sym_visibility"] = ir.StringAttr.get("private")
    for old, new in renamed.items():
        for op in functions:
            ir.SymbolTable.replace_all_symbol_uses(old, new, op.operation)
    main = next(op for op in functions if ir.SymbolTable.get_symbol_name(op).value == entry).operation.opview
    for attribute in ("arg_attrs", "res_attrs"):
        if attribute in main.attributes:
            del main.attributes[attribute]
    body = module.regions[0].blocks[0]
    for op in functions:
        body.append(op.operation)
    return main
