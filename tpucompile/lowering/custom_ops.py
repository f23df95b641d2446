"""JAX lowerings of custom ops (``torch.library.custom_op``), registered by name: the public
``tpucompile.register_lowering``.

A library's own op reaches the lowering whole when a JAX function is registered for it: the function takes the
op's tensor arguments as jax arrays (other arguments as the Python values the graph holds) and returns what
the op returns; it is lowered through ``jax_bridge`` into the module being built, so a Pallas kernel works the
same way. A registration may be for one platform (``platform="tpu"``): it is used when the module is lowered
for that platform, a registration without a platform everywhere else.

Registrations are found by the op's qualified name (``mylib::op``, optionally with an overload), not by the
op object, so a lowering can be registered before the library that defines the op is imported (the project's
own lowering of transformers' grouped matmul is). The ATen rules of ``registry`` are a different table:
those are tpucompile's, keyed by overload, and a custom op that has one cannot be given another here.

Each registration carries a digest of its function's source, which goes into the key of every program that
lowers the op (``key_component``): editing the function compiles anew instead of serving the old program.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import marshal
from collections.abc import Callable, Iterable
from typing import Any

import torch
from jax.extend.mlir import ir

from tpucompile import diagnostics
from tpucompile.errors import LoweringError, UnsupportedOpError
from tpucompile.lowering import jax_bridge
from tpucompile.lowering.registry import LoweringContext, LoweringRule, lookup_rule
from tpucompile.lowering.types import TensorSpec, spec_of

PLATFORMS = ("cpu", "cuda", "tpu")
"""The platforms a registration may be limited to (what ``jax_bridge`` lowers for)."""

OpLike = Any
"""An ``OpOverload``, an ``OpOverloadPacket``, a ``CustomOpDef`` or a qualified name such as ``"mylib::op"``."""


@dataclasses.dataclass(frozen=True)
class JaxLowering:
    """One registration: ``fn`` lowers ``name`` (``ns::op`` or ``ns::op.overload``) on ``platform`` (None: any)."""

    name: str
    fn: Callable[..., Any]
    platform: str | None
    source_digest: str


_LOWERINGS: dict[tuple[str, str | None], JaxLowering] = {}


def register_lowering(op: OpLike, fn: Callable[..., Any] | None = None, *, platform: str | None = None) -> Any:
    """Lower the custom op ``op`` with the JAX function ``fn`` (on ``platform`` only, when given).

    ``fn`` is called with the op's arguments in schema order: each tensor as a jax array, anything else (an
    int, a float, a list of ints, None) as the Python value; it returns a jax array, or a tuple of them for an
    op with several results, with the shapes and dtypes of the op's fake implementation (checked when a graph
    is lowered). Without ``fn`` this returns a decorator. Registering again for the same op and platform
    replaces the earlier function. Returns ``fn``.
    """
    if fn is None:
        return lambda function: register_lowering(op, function, platform=platform)
    if not callable(fn):
        raise TypeError(f"register_lowering({op_name(op)!r}, ...): the lowering must be a JAX function, got "
                        f"{type(fn).__name__}")
    if platform is not None and platform not in PLATFORMS:
        raise ValueError(f"register_lowering({op_name(op)!r}, ...): platform must be one of {PLATFORMS} or None, "
                         f"got {platform!r}")
    name = op_name(op)
    if "::" not in name or name.split("::")[0] in ("aten", "prims"):
        raise ValueError(f"register_lowering: {name} is not a custom op (give torch.ops.mylib.op or 'mylib::op')")
    resolved = _resolved(name)
    if any(lookup_rule(overload) is not None for overload in resolved):
        raise ValueError(f"register_lowering: tpucompile lowers {name} itself")
    _LOWERINGS[(name, platform)] = JaxLowering(name, fn, platform, source_digest(fn))
    return fn


def remove_lowering(op: OpLike, platform: str | None = None) -> bool:
    """Forget the registration of ``op`` for ``platform``; whether there was one."""
    return _LOWERINGS.pop((op_name(op), platform), None) is not None


def op_name(op: OpLike) -> str:
    """``ns::op`` for a packet, a ``CustomOpDef`` or a name; ``ns::op.overload`` for an overload other than
    ``default`` (custom ops have only that one, and ``ns::op`` names it)."""
    if isinstance(op, str):
        return op.removesuffix(".default")
    if isinstance(op, torch._ops.OpOverload):
        overload = op._overloadname
        return op._schema.name if overload == "default" else f"{op._schema.name}.{overload}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    qualname = getattr(op, "_qualname", None)  # a CustomOpDef
    if isinstance(qualname, str):
        return qualname
    raise TypeError(f"register_lowering: expected a custom op (torch.ops.mylib.op or 'mylib::op'), got "
                    f"{type(op).__name__}")


def find(op: Any, platform: str) -> JaxLowering | None:
    """The registration that lowers overload ``op`` on ``platform``: the platform's own, else the general one
    (by overload name first, then by the op's name)."""
    if not isinstance(op, torch._ops.OpOverload) or not _LOWERINGS:
        return None
    names = dict.fromkeys([op_name(op), op._schema.name])
    for key in [(name, p) for p in (platform, None) for name in names]:
        found = _LOWERINGS.get(key)
        if found is not None:
            return found
    return None


def lowers(op: Any, platforms: Iterable[str]) -> bool:
    """Whether a registration lowers overload ``op`` on every one of ``platforms``."""
    return all(find(op, platform) is not None for platform in platforms)


def key_component(ops: Iterable[Any], platform: str) -> list[list[str]]:
    """What the key of a program lowered for ``platform`` holds about the registrations it uses: for each
    op of ``ops`` lowered by one, its name, the registration's platform and the digest of its source."""
    used = {}
    for op in ops:
        found = find(op, platform)
        if found is not None:
            used[found.name, found.platform] = found.source_digest
    return [[name, str(p), digest] for (name, p), digest in sorted(used.items(), key=lambda item: str(item[0]))]


def registrations(platform: str) -> list[list[str]]:
    """``key_component`` of every registration that applies on ``platform``, whatever op it lowers."""
    return [[r.name, str(r.platform), r.source_digest]
            for (_, p), r in sorted(_LOWERINGS.items(), key=lambda item: str(item[0])) if p in (platform, None)]


def source_digest(fn: Callable[..., Any]) -> str:
    """SHA-256 of ``fn``'s source (of its code object where Python has no source for it, as for a function
    typed in a console); a ``functools.partial`` adds its bound arguments."""
    bound = ""
    while hasattr(fn, "func") and hasattr(fn, "args"):  # functools.partial
        bound += repr((fn.args, sorted(getattr(fn, "keywords", {}).items())))
        fn = fn.func
    try:
        text = inspect.getsource(fn).encode()
    except (OSError, TypeError):
        code = getattr(fn, "__code__", None)
        if code is None:
            raise TypeError(f"register_lowering: {fn!r} has neither source nor code to key the cache on") from None
        text = marshal.dumps(code)
    return hashlib.sha256(text + bound.encode()).hexdigest()


def _resolved(name: str) -> list[torch._ops.OpOverload]:
    """The overloads ``name`` stands for, where its library is loaded already (else none)."""
    qualified, _, overload = name.partition(".")
    namespace, _, op = qualified.partition("::")
    packet = getattr(getattr(torch.ops, namespace, None), op, None) if namespace and op else None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return []
    try:
        names = [overload] if overload else packet.overloads()
        return [getattr(packet, n) for n in names]
    except AttributeError:
        return []


def _lower_registered(ctx: LoweringContext, *args: Any, **kwargs: Any) -> Any:
    """The rule of every op with a registration: its JAX function, called for the platform being lowered for,
    its results checked against the op's fake implementation (the node's traced value)."""
    node = ctx.node
    platform = jax_bridge.current_platform()
    found = find(node.target, platform)
    if found is None:
        raise UnsupportedOpError(f"no JAX lowering of {diagnostics.describe_node(node)} is registered for "
                                 f"platform {platform!r}")
    positional = list(args) + [kwargs.get(a.name, a.default_value)
                               for a in node.target._schema.arguments[len(args):]]
    if any(isinstance(a, (list, tuple)) and any(isinstance(x, ir.Value) for x in a) for a in positional):
        raise UnsupportedOpError(f"the JAX lowering of {found.name} would take a list of tensors, which tpucompile "
                                 f"does not pass to JAX functions: {diagnostics.describe_node(node)}")
    operands = [a for a in positional if isinstance(a, ir.Value)]
    slots = [isinstance(a, ir.Value) for a in positional]
    statics = [None if slot else a for a, slot in zip(positional, slots, strict=True)]

    def call(*arrays: Any) -> Any:
        given = iter(arrays)
        values = [next(given) if slot else value for slot, value in zip(slots, statics, strict=True)]
        result = found.fn(*values)
        return tuple(result) if isinstance(result, list) else result

    x64 = any(spec_of(v).dtype in (torch.int64, torch.float64) for v in operands)  # else jax's 32-bit defaults
    params = (found.source_digest, found.platform, repr(statics))
    results = jax_bridge.call(f"{found.name}", call, operands, None, params=params, x64=x64)
    _check_against_fake(node, found, [spec_of(r) for r in results], ctx.avals_out)
    return tuple(results) if isinstance(node.meta.get("val"), (list, tuple)) else results[0]


def _check_against_fake(node: torch.fx.Node, found: JaxLowering, got: list[TensorSpec],
                        expected: list[TensorSpec | None]) -> None:
    if got == expected:
        return
    where = "" if found.platform is None else f" for {found.platform}"
    raise LoweringError(
        f"the JAX lowering of {found.name} registered{where} ({_function_name(found.fn)}) returns "
        f"{_specs(got)}, but the op's fake implementation gives {_specs(expected)}: "
        f"{diagnostics.describe_node(node)}")


def _specs(specs: list[Any]) -> str:
    return "(" + ", ".join("None" if s is None else f"{str(s.dtype).removeprefix('torch.')}{list(s.shape)}"
                           for s in specs) + ")"


def _function_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


REGISTERED_RULE = LoweringRule(_lower_registered, promote=None, operands=None)
"""The rule the graph lowering uses for any op ``registered`` here."""
