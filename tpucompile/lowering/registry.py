"""The table of lowering rules: ATen OpOverload → a small function that emits StableHLO.

A rule is registered once per overload with the policy it needs. With ``promote=KIND`` the registry does
PyTorch's elementwise type promotion (``torch._prims_common.elementwise_dtypes``) and broadcasting before the
rule runs, and the cast to the node's result dtype after it, so an elementwise rule only says which StableHLO
op computes it::

    register_rule(aten.add.Tensor, promote=DEFAULT)(lambda ctx, a, b, alpha=1: ...)

Ops whose result size depends on the data (``nonzero``, ``unique``, …) register with ``bound=``: a function of
the operands' specs giving a static upper bound of that size. The rule then returns its results padded to the
bound, followed by the actual size as an int64 scalar; the runtime cuts the padding off after the call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from jax.extend.mlir import ir
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from tpucompile.lowering import builder
from tpucompile.lowering.types import TensorSpec

PromotionKind = ELEMENTWISE_TYPE_PROMOTION_KIND


@dataclasses.dataclass
class LoweringContext:
    """What a rule may know besides its MLIR operands: the node, and the static types around it."""

    node: torch.fx.Node
    avals_out: list[TensorSpec | None]
    """One spec per result of the op (None for results that are not tensors)."""
    operand_metas: list[Any]
    """``node.meta["val"]`` (fake tensor, SymInt, or the Python value) of each positional argument."""
    compute_dtype: torch.dtype | None = None
    """With a promotion policy: the dtype the operands were converted to."""
    random: Any = None
    """For rules registered with ``random=True``: the program's ``rng.RandomStream``."""
    extent: Callable[[Any, int], ir.Value | None] = lambda meta, dim: None
    """In a bucketed program, the actual (runtime) size of dimension ``dim`` of the operand whose traced
    value is ``meta``, as an ``i32`` scalar, when that dimension is padded to its bucket; else None. Rules
    whose results would read the padded extent as data (a mean's divisor, a position counted from the end)
    use it."""
    runtime_scalars: dict[int, ir.Value] = dataclasses.field(default_factory=dict)
    """In a bucketed program, the positional arguments that are numbers computed from runtime sizes (a mean's
    backward divides by the length, a cache's positions start at its length), each as a scalar value the
    program computes when it runs: the argument the rule gets is its value at the bucket, right only for a
    size that shapes the result. Elementwise rules take these values in place of the number."""
    fixed_in_place: bool = False
    """In a bucketed program: whether a runtime-sized value an op needs in a fixed shape keeps its buffer
    (``dynamic_sizes.fixed_shape``)."""
    narrow_products: bool = False
    """Whether bf16/f16 matrix products write their rounded result directly (``rules/matmul.py``), rather
    than an f32 product and a convert."""
    narrow_elementwise: bool = True
    """Whether elementwise ops registered with ``exact_narrow`` are emitted in their bf16/f16 operands' own
    dtype where that rounds as computing in f32 does (``LoweringRule.exact_narrow``)."""

    def scalar(self, position: int, value: Any, dtype: torch.dtype, shape: Sequence[int]) -> ir.Value:
        """Argument ``position`` (whose number is ``value``) as a ``dtype`` tensor of ``shape``: computed when
        the program runs where it depends on runtime sizes, else a constant."""
        runtime = self.runtime_scalars.get(position)
        if runtime is None:
            return builder.constant(value, dtype, shape)
        return builder.broadcast_to(builder.convert(runtime, dtype), shape)

    @property
    def aval_out(self) -> TensorSpec:
        spec = self.avals_out[0]
        assert spec is not None, f"{self.node.target} has no tensor result"
        return spec


Rule = Callable[..., ir.Value | Sequence[ir.Value]]


@dataclasses.dataclass(frozen=True)
class LoweringRule:
    fn: Rule
    promote: PromotionKind | None
    operands: tuple[int, ...] | None
    random: bool = False
    bound: Callable[..., int] | None = None
    exact_narrow: Callable[[Sequence[Any], dict[str, Any]], bool] | None = None
    """For elementwise rules: whether a call, given its arguments, computed in its bf16/f16 operands' dtype
    gives what computing in f32 and rounding once gives. That holds for IEEE's correctly rounded +, - and *
    (f32 carries at least twice a narrow significand plus two bits, so rounding through it is innocuous) and
    for ops that only pick or compare values. Division and square roots would qualify in IEEE arithmetic, but
    a TPU does not compute them correctly rounded, so they are not marked. Such calls are emitted narrow (with
    ``narrow_elementwise``): the converts around every bf16 op are then XLA's to place inside its fusions,
    where explicit ones let its TPU compiler keep f32 copies of bf16 values in HBM."""
    complex_values: bool = True
    """Whether the rule is right for complex operands; False for rules written after a real-only algorithm,
    which then refuse complex values up front (``unsupported_reason``) rather than compute something else."""
    platforms: frozenset[str] | None = None
    """The platforms whose XLA compiles the rule's program (None: every one); elsewhere the op is refused up
    front and, with the default fallback, runs in eager PyTorch."""

    def __call__(self, ctx: LoweringContext, args: list[Any], kwargs: dict[str, Any]) -> Any:
        if self.promote is None:
            return self.fn(ctx, *args, **kwargs)
        return self._call_elementwise(ctx, args, kwargs)

    def _call_elementwise(self, ctx: LoweringContext, args: list[Any], kwargs: dict[str, Any]) -> Any:
        positions = self.operands
        if positions is None:
            positions = tuple(i for i, a in enumerate(args) if _is_operand(a))
        positions = tuple(p for p in positions if p < len(args) and _is_operand(args[p]))
        promotion_args = [_promotion_arg(ctx.operand_metas[p], args[p]) for p in positions]
        compute_dtype, _ = elementwise_dtypes(*promotion_args, type_promotion_kind=self.promote)
        narrow = self._narrow_dtype(ctx, positions, args, kwargs, compute_dtype)
        if narrow is not None:
            compute_dtype = narrow
        ctx.compute_dtype = compute_dtype
        out_shape = ctx.aval_out.shape
        args = list(args)
        for p in positions:
            arg = args[p]
            if isinstance(arg, ir.Value):
                args[p] = builder.broadcast_to(builder.convert(arg, compute_dtype), out_shape)
            else:
                args[p] = ctx.scalar(p, arg, compute_dtype, out_shape)
        result = self.fn(ctx, *args, **kwargs)
        return builder.convert(result, ctx.aval_out.dtype)

    def _narrow_dtype(self, ctx: LoweringContext, positions: Sequence[int], args: Sequence[Any],
                      kwargs: dict[str, Any], compute_dtype: torch.dtype) -> torch.dtype | None:
        """The bf16/f16 dtype this call is computed in instead of ``compute_dtype``, the f32 that promotion
        widened it to, or None: every tensor operand has that dtype, every number operand is exact in it and
        fixed at compile time, and the rule says the call is exact narrow."""
        if not ctx.narrow_elementwise or self.exact_narrow is None:
            return None
        dtypes = {ctx.operand_metas[p].dtype for p in positions if isinstance(args[p], ir.Value)}
        if len(dtypes) != 1:
            return None
        (narrow,) = dtypes
        if narrow is compute_dtype or builder.accumulator_dtype(narrow) is not compute_dtype:
            return None
        for p in positions:
            number = args[p]
            if isinstance(number, ir.Value):
                continue
            if p in ctx.runtime_scalars or isinstance(number, bool) or not _exact_in(number, narrow):
                return None
        return narrow if self.exact_narrow(args, kwargs) else None


def _exact_in(number: Any, dtype: torch.dtype) -> bool:
    """Whether the Python number converts to ``dtype`` without rounding."""
    if not isinstance(number, (int, float)):
        return False  # a complex number is never narrow: no bf16/f16 operand promotes to complex
    try:
        return torch.tensor(number, dtype=dtype).item() == number
    except (OverflowError, RuntimeError):
        return False


def always(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """``exact_narrow`` for ops exact narrow whatever their other arguments."""
    return True


def _is_operand(arg: Any) -> bool:
    return isinstance(arg, (ir.Value, bool, int, float, complex))


def _promotion_arg(meta: Any, arg: Any) -> Any:
    if isinstance(arg, ir.Value):
        return meta
    return arg  # a Python scalar: it takes part in promotion with lower priority than tensors


_RULES: dict[torch._ops.OpOverload, LoweringRule] = {}


def register_rule(
    *ops: torch._ops.OpOverload | torch._ops.OpOverloadPacket,
    promote: PromotionKind | None = None,
    operands: Sequence[int] | None = None,
    random: bool = False,
    bound: Callable[..., int] | None = None,
    exact_narrow: Callable[[Sequence[Any], dict[str, Any]], bool] | None = None,
    complex_values: bool = True,
    platforms: Sequence[str] | None = None,
) -> Callable[[Rule], Rule]:
    """Register ``fn`` as the lowering of ``ops`` (an overload packet registers all its overloads).

    ``promote`` enables elementwise type promotion and broadcasting of the positional arguments listed in
    ``operands`` (all tensor and scalar positional arguments when None). ``random`` marks ops that draw
    random numbers: their program gets a seed argument and the rule gets ``ctx.random``. ``bound`` marks ops
    with a data-dependent result size: it is called like the op, with a ``TensorSpec`` for each tensor, and
    returns the size the results are padded to. ``exact_narrow`` (elementwise rules) says when a call is
    exact computed in its bf16/f16 operands' own dtype (``LoweringRule.exact_narrow``; ``always`` for ops
    exact whatever their other arguments). ``complex_values=False`` marks rules that are right only for real
    operands; ``platforms`` names the only platforms whose XLA has what the rule emits (a LAPACK call).
    """

    def decorate(fn: Rule) -> Rule:
        rule = LoweringRule(fn, promote, tuple(operands) if operands is not None else None, random, bound,
                            exact_narrow, complex_values, frozenset(platforms) if platforms else None)
        for op in ops:
            overloads = (
                [getattr(op, name) for name in op.overloads()]
                if isinstance(op, torch._ops.OpOverloadPacket)
                else [op]
            )
            for overload in overloads:
                if overload in _RULES:
                    raise ValueError(f"duplicate lowering for {overload}")
                _RULES[overload] = rule
        return fn

    return decorate


def lookup_rule(op: object) -> LoweringRule | None:
    return _RULES.get(op)  # type: ignore[arg-type]


def is_random(op: object) -> bool:
    rule = _RULES.get(op)  # type: ignore[arg-type]
    return rule is not None and rule.random


def size_bound(op: object) -> Callable[..., int] | None:
    """The upper-bound function of an op with a data-dependent result size, or None for any other op."""
    rule = _RULES.get(op)  # type: ignore[arg-type]
    return None if rule is None else rule.bound


def takes_complex(op: object) -> bool:
    """Whether the rule for ``op`` (if any) is right for complex operands."""
    rule = _RULES.get(op)  # type: ignore[arg-type]
    return rule is None or rule.complex_values


def runs_on(op: object, platform: str) -> bool:
    """Whether the rule for ``op`` (if any) emits a program ``platform``'s XLA compiles."""
    rule = _RULES.get(op)  # type: ignore[arg-type]
    return rule is None or rule.platforms is None or platform in rule.platforms
