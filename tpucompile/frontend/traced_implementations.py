"""Traced implementations: a library's custom op (``torch.library.custom_op``) that tpucompile cannot lower
compiles as the ATen ops its Python implementation runs.

For each such op the decomposition table AOTAutograd traces with gets an entry that calls the op's own
implementation on the traced tensors, so its ops land in the graph. The entry sits below autograd: the op's
autograd kernel still runs above it, so the backward is the op's registered formula
(``register_autograd``), itself traced the same way when it calls custom ops (transformers' grouped matmul
calls its own backward op); an op without a formula has no backward, as in eager PyTorch.

An implementation that cannot be traced (Python control flow on tensor values, ``.tolist()``, numpy, a result
size that depends on the values), or whose results differ in shape or dtype from the op's fake
implementation, is found by a dry run on fake tensors of the same shapes, outside the trace, before the real
one: the entry then declines (``NotImplemented``), the op stays whole in the graph and runs as before (lowered
when it has a lowering, else in eager PyTorch with the fallback's warning). A failed trace never leaves half
an implementation, or the symbols of a data-dependent size, in the real graph.

Which ops keep whole is the caller's choice (``lowered``): those with a lowering rule (``tpucompile::attention``)
or a JAX lowering for every platform of the compile. Each entry names the implementation's source digest, so
the table's identity (a cached plan's key) changes when the implementation does.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import marshal
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch._library.custom_ops import OPDEFS, CustomOpDef
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import _disable_current_modes


def custom_op_overloads() -> dict[str, torch._ops.OpOverload]:
    """Every custom op defined in this process with ``torch.library.custom_op``, by qualified name."""
    return {name: opdef._opoverload for name, opdef in list(OPDEFS.items())}


def traced_ops(lowered: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """(name, implementation digest) of every functional custom op whose name is not in ``lowered``."""
    kept = set(lowered)
    return tuple(sorted((name, _implementation_digest(opdef)) for name, opdef in list(OPDEFS.items())
                        if name not in kept and not opdef._opoverload._schema.is_mutable))


def traced_implementations(ops: Iterable[tuple[str, str]]) -> dict[torch._ops.OpOverload, Callable[..., Any]]:
    """The decomposition entries of ``ops`` (from ``traced_ops``)."""
    return {OPDEFS[name]._opoverload: functools.partial(trace_implementation, name, digest)
            for name, digest in ops if name in OPDEFS}


def trace_implementation(name: str, digest: str, *args: Any, **kwargs: Any) -> Any:
    """The op ``name``'s implementation run on the traced arguments (its ops join the graph), or
    ``NotImplemented`` when a dry run shows it cannot be traced. ``digest`` identifies the implementation's
    version (in the table's identity, and in the memo of dry runs)."""
    opdef = OPDEFS.get(name)
    if opdef is None or not _traceable(opdef, digest, args, kwargs):
        return NotImplemented
    return _implementation(opdef, args)(*args, **kwargs)


def _implementation(opdef: CustomOpDef, args: tuple[Any, ...]) -> Callable[..., Any]:
    """The kernel eager PyTorch would run: the one registered for the arguments' device type, else the
    op's own function."""
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), None)
    return opdef._backend_fns.get(device) or opdef._init_fn


_verdicts: dict[tuple[str, str, str], bool] = {}


def _traceable(opdef: CustomOpDef, digest: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the implementation runs on fake tensors like ``args`` (memoised per op, version and argument
    types). Run with the tracer's modes off: nothing it does reaches the graph being traced."""
    try:
        signature = repr(torch.utils._pytree.tree_map(_describe, (args, kwargs)))
    except _Unhinted:
        return False
    key = (opdef._qualname, digest, signature)
    if key not in _verdicts:
        with _disable_current_modes(), unset_fake_temporarily():
            _verdicts[key] = _dry_run(opdef, args, kwargs)
    return _verdicts[key]


def _dry_run(opdef: CustomOpDef, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    mode = FakeTensorMode(allow_non_fake_inputs=False)  # no shape env: a data-dependent size or value raises

    def fake(value: Any) -> Any:
        if isinstance(value, torch.SymInt):
            return _hint(value)
        if not isinstance(value, torch.Tensor):
            return value
        shape, stride = [_hint(s) for s in value.shape], [_hint(s) for s in value.stride()]
        with mode:
            return torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device)

    fake_args, fake_kwargs = torch.utils._pytree.tree_map(fake, (args, kwargs))
    try:
        with mode, torch.no_grad():
            traced = _implementation(opdef, fake_args)(*fake_args, **fake_kwargs)
            promised = opdef._opoverload(*fake_args, **fake_kwargs)  # the fake implementation's results
    except Exception:
        return False
    return _types(traced) == _types(promised)


def _types(value: Any) -> Any:
    return torch.utils._pytree.tree_map(
        lambda v: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__, value)


class _Unhinted(Exception):
    """A size with no example value (a data-dependent one): the dry run cannot be sized."""


def _hint(size: Any) -> int:
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        if hint is None:
            raise _Unhinted(str(size))
        return int(hint)
    return int(size)


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), value.device.type, tuple(_hint(s) for s in value.shape),
                tuple(_hint(s) for s in value.stride()))
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("symbolic", type(value).__name__)
    return value


_digests: dict[Callable[..., Any], str] = {}


def _implementation_digest(opdef: CustomOpDef) -> str:
    """SHA-256 of the implementation's source (its code object where there is no source), and of each kernel
    registered per device type, memoised per function object (a redefinition is a new object)."""
    functions = [opdef._init_fn, *(fn for _, fn in sorted(opdef._backend_fns.items(), key=lambda i: str(i[0])))]
    for fn in functions:
        if fn not in _digests:
            try:
                text = inspect.getsource(fn).encode()
            except (OSError, TypeError):
                code = getattr(fn, "__code__", None)
                name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
                text = marshal.dumps(code) if code is not None else name.encode()  # never an address
            _digests[fn] = hashlib.sha256(text).hexdigest()[:16]
    return "-".join(_digests[fn] for fn in functions)
