"""Prove, from the graph that builds it, what an attention mask is: a causal or sliding-window band, a padding
mask per batch row, or their conjunction, the forms a TPU attention kernel takes without reading a mask.

Real models build their masks inside the compiled graph: Hugging Face compares ``arange`` index tensors
(``kv_idx <= q_idx``, ``kv_idx > q_idx - window``), gathers a padding mask per batch row
(``attention_mask[batch_idx, kv_idx]``) and ``&``s the results; hand-written code does
``torch.ones(n, n, dtype=torch.bool).tril()``. A mask tensor's values at compile time prove nothing (a
padding mask of ones looks like no mask), so this module evaluates the mask's graph abstractly instead:

* an integer tensor is an affine function of index variables, one per ``arange`` and one per dimension of
  a tensor read as data, with the variable each of its dimensions runs along;
* a boolean tensor is a formula over ``expr <= 0`` atoms of such functions and lookups into data tensors
  (graph inputs or values this module does not follow, taken as they are at run time).

Views, broadcasting and indexing move and unify variables; comparisons make atoms. At the attention call
the mask's dimensions are bound to (batch, head, query, key) and the formula is reduced to a conjunction of
bands on ``key - query``, one padding lookup ``valid[batch, key]``, and atoms that hold everywhere on the
index ranges. Anything else (an op this module does not know, a lookup indexed another way, a disjunction)
leaves the mask unproved, and the call keeps the math form: a mask is never guessed.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

__all__ = ["MaskPlan", "prove_mask"]


@dataclass(frozen=True)
class MaskPlan:
    """What a proved mask lets query ``i`` of batch row ``b`` see: key ``j`` with ``i - j <= left`` (unless
    ``left < 0``), ``j - i <= right`` (unless ``right < 0``) and, given ``kv_valid``, ``kv_valid[b, j]``."""

    kv_valid: torch.fx.Node | None
    left: int
    right: int

    def describe(self) -> str:
        parts = []
        if self.right == 0 and self.left < 0:
            parts.append("causal")
        elif self.left >= 0 or self.right >= 0:
            parts.append(f"band [-{self.left if self.left >= 0 else 'inf'}, "
                         f"+{self.right if self.right >= 0 else 'inf'}]")
        if self.kv_valid is not None:
            parts.append(f"padding {self.kv_valid.name}")
        return " & ".join(parts) or "no mask"


class Unproved(Exception):
    """The mask's graph leaves the proof (the message says where)."""


# --- integer expressions -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Affine:
    """``const + sum(coefficient * variable)``."""

    terms: tuple[tuple[int, int], ...] = ()
    const: int = 0

    @staticmethod
    def of(var: int) -> Affine:
        return Affine(((var, 1),), 0)

    def _combine(self, other: Affine, sign: int) -> Affine:
        terms = dict(self.terms)
        for var, coefficient in other.terms:
            terms[var] = terms.get(var, 0) + sign * coefficient
        return Affine(tuple(sorted((v, c) for v, c in terms.items() if c)), self.const + sign * other.const)

    def __add__(self, other: Affine) -> Affine:
        return self._combine(other, 1)

    def __sub__(self, other: Affine) -> Affine:
        return self._combine(other, -1)

    def scaled(self, factor: int) -> Affine:
        return Affine(tuple((v, c * factor) for v, c in self.terms if c * factor), self.const * factor)

    def subst(self, mapping: dict[int, Affine]) -> Affine:
        result = Affine((), self.const)
        for var, coefficient in self.terms:
            result = result + (mapping[var].scaled(coefficient) if var in mapping
                               else Affine(((var, coefficient),)))
        return result


# --- boolean formulas --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Const:
    value: bool


@dataclass(frozen=True)
class AtMost:
    """``expr <= 0``."""

    expr: Affine


@dataclass(frozen=True)
class Lookup:
    """The boolean data tensor ``node`` read at ``index``."""

    node: torch.fx.Node
    index: tuple[Affine, ...]


@dataclass(frozen=True)
class Not:
    arg: Any


@dataclass(frozen=True)
class All:
    args: tuple


@dataclass(frozen=True)
class Either:
    args: tuple


def _subst(formula: Any, mapping: dict[int, Affine]) -> Any:
    if isinstance(formula, Affine):
        return formula.subst(mapping)
    if isinstance(formula, AtMost):
        return AtMost(formula.expr.subst(mapping))
    if isinstance(formula, Lookup):
        return Lookup(formula.node, tuple(e.subst(mapping) for e in formula.index))
    if isinstance(formula, Not):
        return Not(_subst(formula.arg, mapping))
    if isinstance(formula, (All, Either)):
        return type(formula)(tuple(_subst(a, mapping) for a in formula.args))
    return formula


# --- abstract tensors --------------------------------------------------------------------------------------


@dataclass
class Value:
    """A tensor as a formula (``Affine`` for integers, a boolean formula for booleans) and, per dimension,
    the variable that dimension runs along (None: the tensor is the same along it)."""

    formula: Any
    dims: tuple[int | None, ...]
    shape: tuple[int, ...]

    @property
    def boolean(self) -> bool:
        return not isinstance(self.formula, Affine)


@dataclass
class _Prover:
    sizes: dict[int, int] = field(default_factory=dict)
    values: dict[torch.fx.Node, Value] = field(default_factory=dict)
    counter: itertools.count = field(default_factory=itertools.count)

    def fresh(self, size: int) -> int:
        var = next(self.counter)
        self.sizes[var] = size
        return var

    # --- evaluation ----------------------------------------------------------------------------------------

    def value(self, arg: Any) -> Value:
        if isinstance(arg, torch.fx.Node):
            if arg not in self.values:
                self.values[arg] = self._evaluate(arg)
            return self.values[arg]
        if isinstance(arg, bool):
            return Value(Const(arg), (), ())
        if isinstance(arg, int):
            return Value(Affine((), arg), (), ())
        raise Unproved(f"it uses the constant {arg!r}")

    def _evaluate(self, node: torch.fx.Node) -> Value:
        try:
            return self._rule(node)
        except Unproved:
            example = _example(node)
            if isinstance(example, torch.Tensor) and example.dtype == torch.bool and _static(example):
                return self._data(node, tuple(example.shape))
            raise

    def _data(self, node: torch.fx.Node, shape: tuple[int, ...]) -> Value:
        """A boolean tensor taken as it is at run time: a lookup at its own index variables."""
        dims = tuple(self.fresh(size) if size != 1 else None for size in shape)
        index = tuple(Affine.of(v) if v is not None else Affine() for v in dims)
        return Value(Lookup(node, index), dims, shape)

    def _rule(self, node: torch.fx.Node) -> Value:
        example = _example(node)
        if not isinstance(example, torch.Tensor) or not _static(example):
            raise Unproved(f"{node.name} has no static tensor value")
        shape = tuple(example.shape)
        target, args, kwargs = node.target, node.args, node.kwargs
        name = target if node.op == "call_method" else getattr(target, "__name__", str(target))
        if node.op == "call_function" and target is torch.arange:
            return self._arange(args, shape)
        if name in ("new_ones", "ones") and example.dtype == torch.bool:
            return Value(Const(True), (None,) * len(shape), shape)
        if name in ("tril", "triu"):
            return self._band(node, name, args, kwargs, shape)
        if name in ("to", "bool", "contiguous", "clone", "long", "int") or (node.op == "call_function"
                                                                               and target is torch.Tensor.to):
            return self._converted(node, args, example)
        if name in ("unsqueeze", "expand", "view", "reshape", "expand_as"):
            return self._viewed(self.value(args[0]), shape, expand=name.startswith("expand"))
        if node.op == "call_function" and target is operator.getitem:
            return self._indexed(self.value(args[0]), args[1], shape)
        if name in ("neg", "__neg__"):
            source = self.value(args[0])
            if source.boolean:
                raise Unproved("a negated boolean")
            return Value(source.formula.scaled(-1), source.dims, shape)
        if name in _ARITHMETIC:
            return self._arithmetic(_ARITHMETIC[name], args, shape)
        if name in _COMPARISONS:
            return self._compared(_COMPARISONS[name], args, shape)
        if name in _LOGIC:
            return self._logic(_LOGIC[name], args, shape)
        raise Unproved(f"{node.name} ({name}) is not an index computation")

    def _arange(self, args: tuple, shape: tuple[int, ...]) -> Value:
        numbers = [a for a in args if not isinstance(a, torch.fx.Node)]
        if len(numbers) != len(args) or not all(isinstance(a, int) for a in numbers):
            raise Unproved("an arange has traced or non-integer bounds")
        start, step = (0, 1) if len(args) == 1 else (args[0], args[2] if len(args) > 2 else 1)
        if shape[0] == 1:
            return Value(Affine((), start), (None,), shape)
        var = self.fresh(shape[0])
        return Value(Affine(((var, step),), start), (var,), shape)

    def _band(self, node, name, args, kwargs, shape) -> Value:
        source = self.value(args[0])
        diagonal = kwargs.get("diagonal", args[1] if len(args) > 1 else 0)
        if source.formula != Const(True) or len(shape) < 2 or not isinstance(diagonal, int):
            raise Unproved(f"{node.name} ({name}) is not of a tensor of ones")
        row, column = self.fresh(shape[-2]), self.fresh(shape[-1])
        offset = Affine.of(column) - Affine.of(row) - Affine((), diagonal)
        atom = AtMost(offset) if name == "tril" else AtMost(offset.scaled(-1))
        return Value(atom, (*source.dims[:-2], row, column), shape)

    def _converted(self, node, args, example) -> Value:
        source = self.value(args[0])
        if source.boolean != (example.dtype == torch.bool):
            raise Unproved(f"{node.name} converts between booleans and numbers")
        if not source.boolean and (example.dtype.is_floating_point or example.dtype.is_complex):
            raise Unproved(f"{node.name} converts indices to {example.dtype}")
        return source

    def _viewed(self, source: Value, shape: tuple[int, ...], expand: bool) -> Value:
        """Views that only add, drop or (``expand``) broadcast dimensions of size 1."""
        if expand:
            lead = len(shape) - len(source.shape)
            if lead < 0:
                raise Unproved("an expand drops dimensions")
            dims: list[int | None] = [None] * lead
            for old, new, var in zip(source.shape, shape[lead:], source.dims, strict=True):
                if old != new and old != 1:
                    raise Unproved("an expand changes a dimension")
                dims.append(var if old == new else None)
            return Value(source.formula, tuple(dims), shape)
        kept = [(size, var) for size, var in zip(source.shape, source.dims, strict=True) if size != 1]
        if [size for size, _ in kept] != [size for size in shape if size != 1]:
            raise Unproved("a view regroups dimensions")
        variables = iter(var for _, var in kept)
        return Value(source.formula, tuple(next(variables) if size != 1 else None for size in shape), shape)

    def _indexed(self, source: Value, index: Any, shape: tuple[int, ...]) -> Value:
        items = list(index) if isinstance(index, tuple) else [index]
        if sum(item is Ellipsis for item in items) > 1:
            raise Unproved("an index has two ellipses")
        consumed = sum(1 for item in items if item is not None and item is not Ellipsis)
        if Ellipsis in items:
            at = items.index(Ellipsis)
            items[at:at + 1] = [slice(None)] * (len(source.shape) - consumed)
        items += [slice(None)] * (len(source.shape) - sum(1 for item in items if item is not None))
        advanced = [i for i, item in enumerate(items) if isinstance(item, torch.fx.Node)]
        if advanced and advanced != list(range(advanced[0], advanced[-1] + 1)):
            raise Unproved("an index mixes separated index tensors")
        mapping: dict[int, Affine] = {}
        dims: list[int | None] = []
        index_values = [self.value(items[i]) for i in advanced]
        if any(v.boolean for v in index_values):
            raise Unproved("a boolean tensor indexes the mask")
        broadcast = _broadcast_dims(self, index_values, mapping) if index_values else ()
        position = 0
        for i, item in enumerate(items):
            if item is None:
                dims.append(None)
                continue
            size, var = source.shape[position], source.dims[position]
            position += 1
            if isinstance(item, torch.fx.Node):
                if var is not None:
                    mapping[var] = index_values[advanced.index(i)].formula.subst(mapping)
                elif size != 1:
                    raise Unproved("an index tensor reads a broadcast dimension")
                if i == advanced[0]:
                    dims.extend(broadcast)
            elif isinstance(item, int):
                if var is not None:
                    mapping[var] = Affine((), item % size)
            elif isinstance(item, slice) and item.step in (None, 1) and all(
                    isinstance(b, (int, type(None))) for b in (item.start, item.stop)):
                start, stop, _ = item.indices(size)
                if var is None or (start, stop) == (0, size):
                    dims.append(var if stop - start != 1 or var is None else None)
                    if var is not None and stop - start == 1:
                        mapping[var] = Affine((), start)
                else:
                    new = self.fresh(stop - start)
                    mapping[var] = Affine.of(new) + Affine((), start)
                    dims.append(new)
            else:
                raise Unproved(f"an index item {item!r} is not understood")
        result = Value(_subst(source.formula, mapping), tuple(dims), shape)
        if len(result.dims) != len(shape):
            raise Unproved("an index's result has another rank")
        return result

    def _binary(self, args: tuple, shape: tuple[int, ...]) -> tuple[Value, Value, tuple[int | None, ...]]:
        left, right = self.value(args[0]), self.value(args[1])
        mapping: dict[int, Affine] = {}
        dims = _broadcast_dims(self, [left, right], mapping)
        if len(dims) != len(shape):
            raise Unproved("a broadcast has another rank")
        return (Value(_subst(left.formula, mapping), left.dims, left.shape),
                Value(_subst(right.formula, mapping), right.dims, right.shape), dims)

    def _arithmetic(self, op: str, args: tuple, shape: tuple[int, ...]) -> Value:
        left, right, dims = self._binary(args, shape)
        if left.boolean or right.boolean:
            raise Unproved(f"{op} of booleans")
        if op == "add":
            return Value(left.formula + right.formula, dims, shape)
        if op == "sub":
            return Value(left.formula - right.formula, dims, shape)
        constant = right.formula if not right.formula.terms else left.formula if not left.formula.terms else None
        if constant is None:
            raise Unproved("a product of two index tensors")
        other = left.formula if constant is right.formula else right.formula
        return Value(other.scaled(constant.const), dims, shape)

    def _compared(self, op: str, args: tuple, shape: tuple[int, ...]) -> Value:
        left, right, dims = self._binary(args, shape)
        if left.boolean or right.boolean:
            raise Unproved(f"{op} of booleans")
        difference = left.formula - right.formula  # left - right
        one = Affine((), 1)
        atoms = {"le": AtMost(difference), "lt": AtMost(difference + one),
                 "ge": AtMost(difference.scaled(-1)), "gt": AtMost(difference.scaled(-1) + one)}
        if op in atoms:
            return Value(atoms[op], dims, shape)
        equal = All((AtMost(difference), AtMost(difference.scaled(-1))))
        return Value(equal if op == "eq" else Not(equal), dims, shape)

    def _logic(self, op: str, args: tuple, shape: tuple[int, ...]) -> Value:
        if op == "not":
            source = self.value(args[0])
            if not source.boolean:
                raise Unproved("a bitwise not of integers")
            return Value(Not(source.formula), source.dims, shape)
        left, right, dims = self._binary(args, shape)
        if not (left.boolean and right.boolean):
            raise Unproved(f"logical {op} of integers")
        return Value((All if op == "and" else Either)((left.formula, right.formula)), dims, shape)


_ARITHMETIC = {"add": "add", "sub": "sub", "mul": "mul", "__add__": "add", "__sub__": "sub", "__mul__": "mul",
               "__radd__": "add", "__rmul__": "mul"}
_COMPARISONS = {name: name for name in ("le", "lt", "ge", "gt", "eq", "ne")}
_COMPARISONS.update({f"__{name}__": name for name in ("le", "lt", "ge", "gt", "eq", "ne")})
_LOGIC = {"and_": "and", "or_": "or", "invert": "not", "logical_and": "and", "logical_or": "or",
          "logical_not": "not", "bitwise_and": "and", "bitwise_or": "or", "bitwise_not": "not",
          "__and__": "and", "__or__": "or", "__invert__": "not"}


def _broadcast_dims(prover: _Prover, values: list[Value], mapping: dict[int, Affine]) -> tuple[int | None, ...]:
    """The dims of ``values`` broadcast together; variables that meet on one dimension are unified (recorded
    in ``mapping``, which the caller applies to the formulas)."""
    rank = max(len(v.dims) for v in values)
    dims: list[int | None] = []
    for position in range(rank):
        chosen: int | None = None
        for value in values:
            offset = position - (rank - len(value.dims))
            if offset < 0:
                continue
            var = value.dims[offset]
            if var is None:
                continue
            var = _resolved(var, mapping)
            if chosen is None:
                chosen = var
            elif var != chosen:
                if prover.sizes[var] != prover.sizes[chosen]:
                    raise Unproved("index variables of different lengths meet")
                mapping[var] = Affine.of(chosen)
        dims.append(chosen)
    for var in list(mapping):
        mapping[var] = mapping[var].subst(mapping)
    return tuple(dims)


def _resolved(var: int, mapping: dict[int, Affine]) -> int:
    while var in mapping and len(mapping[var].terms) == 1 and mapping[var].terms[0][1] == 1 \
            and mapping[var].const == 0:
        var = mapping[var].terms[0][0]
    return var


# --- reduction to a plan -----------------------------------------------------------------------------------

_BATCH, _HEAD, _QUERY, _KEY = -1, -2, -3, -4


def prove_mask(mask: torch.fx.Node, attention_shape: tuple[int, int, int, int], additive: bool = False,
               causal: bool = False) -> MaskPlan | str:
    """The plan a boolean mask ``mask`` (or, with ``additive``, a float mask of 0 and -inf) is proved to be,
    for attention of ``(batch, heads, length_q, length_k)`` scores, combined with ``causal``; else the reason
    it is not proved."""
    prover = _Prover()
    try:
        boolean = _boolean_of_additive(mask) if additive else mask
        value = prover.value(boolean)
        if not value.boolean:
            raise Unproved("the mask is not boolean")
        formula = _bound(prover, value, attention_shape)
        return _plan(formula, attention_shape, causal, prover.sizes)
    except Unproved as refusal:
        return str(refusal)


def _boolean_of_additive(mask: torch.fx.Node) -> torch.fx.Node:
    """The boolean ``keep`` of ``torch.where(keep, 0, -inf)``."""
    name = getattr(mask.target, "__name__", str(mask.target))
    if mask.op == "call_function" and name == "where" and len(mask.args) == 3:
        keep, kept, dropped = mask.args
        if kept == 0 and dropped == -math.inf and isinstance(keep, torch.fx.Node):
            return keep
    raise Unproved("the float mask is not torch.where(mask, 0, -inf)")


def _bound(prover: _Prover, value: Value, attention_shape: tuple[int, int, int, int]) -> Any:
    """The formula with its dimensions bound to (batch, head, query, key)."""
    if len(value.dims) > 4:
        raise Unproved("the mask has more than 4 dimensions")
    axes = (_BATCH, _HEAD, _QUERY, _KEY)[4 - len(value.dims):]
    sizes = attention_shape[4 - len(value.dims):]
    mapping = {}
    for var, axis, size, own in zip(value.dims, axes, sizes, value.shape, strict=True):
        if own not in (1, size):
            raise Unproved("the mask's shape does not broadcast to the scores'")
        if var is not None:
            mapping[var] = Affine.of(axis)
    return _subst(value.formula, mapping)


def _plan(formula: Any, attention_shape: tuple[int, int, int, int], causal: bool,
          sizes: dict[int, int]) -> MaskPlan:
    batch, heads, length_q, length_k = attention_shape
    ranges = {_BATCH: batch, _HEAD: heads, _QUERY: length_q, _KEY: length_k}
    left, right, kv_valid = -1, 0 if causal else -1, None
    for atom in _conjuncts(formula):
        if isinstance(atom, Const):
            if not atom.value:
                raise Unproved("the mask hides every key")
            continue
        if isinstance(atom, Lookup):
            if kv_valid is not None and atom.node is not kv_valid:
                raise Unproved("two padding masks")
            kv_valid = _padding(atom, batch, length_k)
            continue
        if not isinstance(atom, AtMost):
            raise Unproved("the mask holds a negated lookup or a disjunction")
        terms = dict(atom.expr.terms)
        if any(var not in ranges for var in terms):
            raise Unproved("the mask depends on an index that is not one of its dimensions")
        low, high = _bounds(atom.expr, ranges)
        if high <= 0:
            continue  # holds everywhere
        if low > 0:
            raise Unproved("the mask hides every key")
        if terms == {_KEY: 1, _QUERY: -1} and -atom.expr.const >= 0:
            right = -atom.expr.const if right < 0 else min(right, -atom.expr.const)
        elif terms == {_KEY: -1, _QUERY: 1} and -atom.expr.const >= 0:
            left = -atom.expr.const if left < 0 else min(left, -atom.expr.const)
        else:
            raise Unproved(f"an atom {_show(atom.expr)} <= 0 is not a band on key - query")
    if left >= length_q - 1:
        left = -1
    if right >= length_k - 1:
        right = -1
    return MaskPlan(kv_valid, left, right)


def _conjuncts(formula: Any) -> list[Any]:
    """The formula as a list of atoms, all of which must hold (negations pushed onto atoms)."""
    if isinstance(formula, All):
        return [atom for arg in formula.args for atom in _conjuncts(arg)]
    if isinstance(formula, Not):
        inner = formula.arg
        if isinstance(inner, AtMost):
            return [AtMost(inner.expr.scaled(-1) + Affine((), 1))]
        if isinstance(inner, Not):
            return _conjuncts(inner.arg)
        if isinstance(inner, Const):
            return [Const(not inner.value)]
        if isinstance(inner, Either):
            return _conjuncts(All(tuple(Not(arg) for arg in inner.args)))
        return [formula]
    if isinstance(formula, Either):
        live = [arg for arg in formula.args if _conjuncts(arg) != [Const(False)]]
        if len(live) == 1:
            return _conjuncts(live[0])
        return [formula]
    return [formula]


def _bounds(expr: Affine, ranges: dict[int, int]) -> tuple[int, int]:
    low = high = expr.const
    for var, coefficient in expr.terms:
        extreme = coefficient * (ranges[var] - 1)
        low, high = low + min(0, extreme), high + max(0, extreme)
    return low, high


def _padding(atom: Lookup, batch: int, length_k: int) -> torch.fx.Node:
    """The ``(batch, length_k)`` boolean tensor a lookup ``valid[batch, key]`` reads."""
    example = _example(atom.node)
    if (tuple(example.shape) == (batch, length_k) and atom.index == (Affine.of(_BATCH), Affine.of(_KEY))):
        return atom.node
    raise Unproved(f"{atom.node.name} is read at ({', '.join(_show(e) for e in atom.index)}), "
                   "not as a padding mask [batch, key]")


def _show(expr: Affine) -> str:
    names = {_BATCH: "batch", _HEAD: "head", _QUERY: "query", _KEY: "key"}
    parts = [f"{c}*{names.get(v, f'v{v}')}" for v, c in expr.terms]
    return " + ".join(parts + ([str(expr.const)] if expr.const or not parts else [])) or "0"


def _example(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else node


def _static(tensor: torch.Tensor) -> bool:
    return not any(isinstance(s, torch.SymInt) for s in tensor.shape)
