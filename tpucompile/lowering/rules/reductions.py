"""Reductions with PyTorch's result dtypes: integer and bool sums give int64 (the traced graph says which),
low-precision floats accumulate in f32, max/min propagate NaN, argmax/argmin return the first index of
the extreme value and treat NaN as the extreme. Also the cumulative scans (cumsum, cumprod, logcumsumexp)
and vector norms."""

from __future__ import annotations

import math

import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering import builder, dynamic_sizes
from tpucompile.lowering.registry import register_rule

aten = torch.ops.aten


def _dims(x, dim) -> list[int]:
    rank = builder.rank_of(x)
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(rank))
    if isinstance(dim, int):
        dim = [dim]
    return sorted({d % rank for d in dim}) if rank else []


def _keep(ctx, value):
    """Reshape a reduced value to the traced result shape (restores kept dims)."""
    return builder.reshape(value, ctx.aval_out.shape)


@register_rule(aten.sum.dim_IntList, aten.sum.default)
def _sum(ctx, x, dim=None, keepdim=False, *, dtype=None):
    out = ctx.aval_out.dtype
    x = builder.convert(x, builder.accumulator_dtype(out))
    return _keep(ctx, builder.convert(builder.reduce_sum(x, _dims(x, dim)), out))


def _count(ctx, x, dims: list[int]) -> int | ir.Value:
    """How many elements a reduction over ``dims`` of operand ``x`` takes in (the padding not counted)."""
    return dynamic_sizes.element_count(ctx.extent, ctx.operand_metas[0], builder.shape_of(x), dims)


def _divided(total: ir.Value, count: int | ir.Value, correction: float = 0) -> ir.Value:
    """``total / max(count - correction, 0)`` in ``total``'s dtype."""
    dtype, shape = builder.dtype_of(total), builder.shape_of(total)
    if isinstance(count, int):
        return hlo.divide(total, builder.constant(max(count - correction, 0), dtype, shape))
    divisor = builder.convert(count, dtype)
    if correction:
        divisor = hlo.maximum(hlo.subtract(divisor, builder.constant(correction, dtype, ())),
                              builder.constant(0, dtype, ()))
    return hlo.divide(total, builder.broadcast_to(divisor, shape))


@register_rule(aten.mean.dim, aten.mean.default)
def _mean(ctx, x, dim=None, keepdim=False, *, dtype=None):
    out = ctx.aval_out.dtype
    dims = _dims(x, dim)
    count = _count(ctx, x, dims)
    x = builder.convert(x, builder.accumulator_dtype(out))
    return _keep(ctx, builder.convert(_divided(builder.reduce_sum(x, dims), count), out))


@register_rule(aten.prod.default, aten.prod.dim_int)
def _prod(ctx, x, dim=None, keepdim=False, *, dtype=None):
    out = ctx.aval_out.dtype
    x = builder.convert(x, builder.accumulator_dtype(out))
    one = builder.constant(1, builder.dtype_of(x), ())
    dims = _dims(x, dim)
    result = builder.reduce([x], [one], dims, lambda acc, el: [hlo.multiply(acc[0], el[0])])[0] if dims else x
    return _keep(ctx, builder.convert(result, out))


@register_rule(aten.amax.default, aten.max.default)
def _amax(ctx, x, dim=None, keepdim=False):
    return _keep(ctx, builder.reduce_max(x, _dims(x, dim)))


@register_rule(aten.amin.default, aten.min.default)
def _amin(ctx, x, dim=None, keepdim=False):
    return _keep(ctx, builder.reduce_min(x, _dims(x, dim)))


@register_rule(aten.any.default, aten.any.dim, aten.any.dims)
def _any(ctx, x, dim=None, keepdim=False):
    x = builder.convert(x, torch.bool)
    return _keep(ctx, builder.convert(builder.reduce_max(x, _dims(x, dim)), ctx.aval_out.dtype))


@register_rule(aten.all.default, aten.all.dim, aten.all.dims)
def _all(ctx, x, dim=None, keepdim=False):
    x = builder.convert(x, torch.bool)
    return _keep(ctx, builder.convert(builder.reduce_min(x, _dims(x, dim)), ctx.aval_out.dtype))


def arg_extreme(x: ir.Value, dim: int, is_max: bool) -> list[ir.Value]:
    """(values, int64 indices) of the max/min along ``dim``: first index wins ties, NaN counts as extreme."""
    shape = builder.shape_of(x)
    dtype = builder.dtype_of(x)
    indices = builder.iota(shape, torch.int64, dim)
    init_value = builder.constant(builder.min_value(dtype) if is_max else builder.max_value(dtype), dtype, ())
    init_index = builder.constant(0, torch.int64, ())
    direction = "GT" if is_max else "LT"

    def body(acc, el):
        (a, ia), (b, ib) = acc, el
        a_better = builder.compare(a, b, direction)
        equal = builder.compare(a, b, "EQ")
        if dtype.is_floating_point:
            a_nan, b_nan = builder.is_nan(a), builder.is_nan(b)
            a_better = hlo.or_(a_better, hlo.and_(a_nan, hlo.not_(b_nan)))
            equal = hlo.or_(equal, hlo.and_(a_nan, b_nan))
        pick_a = hlo.or_(a_better, hlo.and_(equal, builder.compare(ia, ib, "LT")))
        return [builder.select(pick_a, a, b), builder.select(pick_a, ia, ib)]

    return builder.reduce([x, indices], [init_value, init_index], [dim], body)


@register_rule(aten.argmax.default)
def _argmax(ctx, x, dim=None, keepdim=False):
    if dim is None or builder.rank_of(x) == 0:  # over all elements (a 0-d tensor is one element)
        x, dim = builder.reshape(x, (math.prod(builder.shape_of(x)),)), 0
    return _keep(ctx, arg_extreme(x, dim % max(builder.rank_of(x), 1), True)[1])


@register_rule(aten.argmin.default)
def _argmin(ctx, x, dim=None, keepdim=False):
    if dim is None or builder.rank_of(x) == 0:  # over all elements (a 0-d tensor is one element)
        x, dim = builder.reshape(x, (math.prod(builder.shape_of(x)),)), 0
    return _keep(ctx, arg_extreme(x, dim % max(builder.rank_of(x), 1), False)[1])


def _values_and_indices(ctx, x, dim, is_max):
    if builder.rank_of(x) == 0:
        return x, builder.constant(0, torch.int64, ())
    values, indices = arg_extreme(x, dim % builder.rank_of(x), is_max)
    return (builder.reshape(values, ctx.avals_out[0].shape), builder.reshape(indices, ctx.avals_out[1].shape))


@register_rule(aten.max.dim)
def _max_dim(ctx, x, dim, keepdim=False):
    return _values_and_indices(ctx, x, dim, True)


@register_rule(aten.min.dim)
def _min_dim(ctx, x, dim, keepdim=False):
    return _values_and_indices(ctx, x, dim, False)


def _variance(ctx, x, dims, correction):
    count = _count(ctx, x, dims)
    shape = builder.shape_of(x)
    mean = _divided(builder.reduce_sum(x, dims), count)
    kept = [1 if i in dims else s for i, s in enumerate(shape)]
    centered = hlo.subtract(x, builder.broadcast_to(builder.reshape(mean, kept), shape))
    if builder.dtype_of(centered).is_complex:  # the mean squared distance: |z - mean|², a real number
        real, imaginary = builder.real_part(centered), builder.imaginary_part(centered)
        squares = hlo.add(hlo.multiply(real, real), hlo.multiply(imaginary, imaginary))
    else:
        squares = hlo.multiply(centered, centered)
    var = _divided(builder.reduce_sum(squares, dims), count, correction)
    return var, mean


def _in_accumulator(x, out: torch.dtype):
    """``x`` in the dtype a reduction of it to ``out`` computes in; a complex input stays complex, since its
    real results (variances, norms) are taken from the complex values."""
    if builder.dtype_of(x).is_complex:
        return x
    return builder.convert(x, builder.accumulator_dtype(out))


def _correction(correction, unbiased=None):
    if correction is not None:
        return correction
    return 1 if unbiased is None or unbiased else 0


@register_rule(aten.var.correction)
def _var(ctx, x, dim=None, *, correction=None, keepdim=False):
    out = ctx.aval_out.dtype
    x = _in_accumulator(x, out)
    var, _ = _variance(ctx, x, _dims(x, dim), _correction(correction))
    return _keep(ctx, builder.convert(var, out))


@register_rule(aten.std.correction)
def _std(ctx, x, dim=None, *, correction=None, keepdim=False):
    out = ctx.aval_out.dtype
    x = _in_accumulator(x, out)
    var, _ = _variance(ctx, x, _dims(x, dim), _correction(correction))
    return _keep(ctx, builder.convert(hlo.sqrt(var), out))


@register_rule(aten.var_mean.correction)
def _var_mean(ctx, x, dim=None, *, correction=None, keepdim=False):
    var_out, mean_out = ctx.avals_out[0].dtype, ctx.avals_out[1].dtype
    x = _in_accumulator(x, var_out)
    var, mean = _variance(ctx, x, _dims(x, dim), _correction(correction))
    shape = ctx.avals_out[0].shape
    return (builder.reshape(builder.convert(var, var_out), shape),
            builder.reshape(builder.convert(mean, mean_out), shape))


def _scan(x, dim: int, combine, identity):
    """Inclusive prefix scan along ``dim`` in log2(n) steps (Hillis-Steele): at step k every element
    combines with the one 2**k before it, read from a copy shifted by a ``pad`` (negative high padding
    drops the elements shifted out)."""
    shape = builder.shape_of(x)
    size = shape[dim]
    fill = builder.constant(identity, builder.dtype_of(x), ())
    zeros = [0] * len(shape)
    shift = 1
    while shift < size:
        low, high = list(zeros), list(zeros)
        low[dim], high[dim] = shift, -shift
        x = combine(x, hlo.pad(x, fill, low, high, zeros))
        shift *= 2
    return x


def _cumulative(ctx, x, dim, combine, identity):
    out = ctx.aval_out.dtype
    x = builder.convert(x, builder.accumulator_dtype(out))
    if builder.rank_of(x) == 0:
        return builder.convert(x, out)
    return builder.convert(_scan(x, dim % builder.rank_of(x), combine, identity), out)


@register_rule(aten.cumsum.default)
def _cumsum(ctx, x, dim, *, dtype=None):
    return _cumulative(ctx, x, dim, hlo.add, 0)


@register_rule(aten.cumprod.default)
def _cumprod(ctx, x, dim, *, dtype=None):
    return _cumulative(ctx, x, dim, hlo.multiply, 1)


@register_rule(aten.logcumsumexp.default)
def _logcumsumexp(ctx, x, dim):
    def log_add_exp(a, b):
        # log(exp(a) + exp(b)) = max + log1p(exp(min - max)). Equal operands skip the subtraction, so
        # that two infinities of the same sign give that infinity, not inf - inf = NaN.
        high, low = hlo.maximum(a, b), hlo.minimum(a, b)
        zero = builder.constant(0, builder.dtype_of(a), builder.shape_of(a))
        gap = builder.select(builder.compare(high, low, "EQ"), zero, hlo.subtract(low, high))
        return hlo.add(high, hlo.log_plus_one(hlo.exponential(gap)))

    return _cumulative(ctx, x, dim, log_add_exp, float("-inf"))


@register_rule(aten.linalg_vector_norm.default)
def _vector_norm(ctx, x, ord=2, dim=None, keepdim=False, *, dtype=None):
    out = ctx.aval_out.dtype
    if builder.dtype_of(x).is_complex:
        x = hlo.abs(x)  # the norm of complex values is the norm of their magnitudes
    x = builder.convert(x, builder.accumulator_dtype(out))
    dims = _dims(x, dim)
    compute = builder.dtype_of(x)
    magnitude = hlo.abs(x)
    if ord == float("inf"):
        result = builder.reduce_max(magnitude, dims)
    elif ord == float("-inf"):
        result = builder.reduce_min(magnitude, dims)
    elif ord == 0:
        nonzero = builder.compare(x, builder.constant(0, compute, builder.shape_of(x)), "NE")
        result = builder.reduce_sum(builder.convert(nonzero, compute), dims)
    elif ord == 1:
        result = builder.reduce_sum(magnitude, dims)
    elif ord == 2:
        result = hlo.sqrt(builder.reduce_sum(hlo.multiply(x, x), dims))
    else:
        power = builder.constant(ord, compute, builder.shape_of(x))
        total = builder.reduce_sum(hlo.power(magnitude, power), dims)
        result = hlo.power(total, builder.constant(1.0 / ord, compute, builder.shape_of(total)))
    return _keep(ctx, builder.convert(result, out))
