"""Complex values taken apart and put together: real and imaginary parts, conjugates, and the trailing pair
of floats that ``torch.view_as_real`` shows."""

from __future__ import annotations

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering.builder.dtypes import dtype_of
from tpucompile.lowering.builder.shapes import concatenate, reshape, shape_of, slice_along


def real_part(value: ir.Value) -> ir.Value:
    """The real part of a complex value; a real value as it is."""
    return hlo.real(value) if dtype_of(value).is_complex else value


def imaginary_part(value: ir.Value) -> ir.Value:
    """The imaginary part of a complex value (``stablehlo.imag`` gives zeros for a real one)."""
    return hlo.imag(value)


def from_parts(real: ir.Value, imaginary: ir.Value) -> ir.Value:
    """The complex value ``real + i·imaginary`` of two same-typed float tensors."""
    return hlo.complex(real, imaginary)


def conjugate(value: ir.Value) -> ir.Value:
    """The complex conjugate; a real value as it is. StableHLO has no conjugate op."""
    if not dtype_of(value).is_complex:
        return value
    return hlo.complex(hlo.real(value), hlo.negate(hlo.imag(value)))


def as_float_pairs(value: ir.Value) -> ir.Value:
    """A complex tensor as floats with a trailing dimension of 2 (real, imaginary): ``view_as_real``."""
    shape = shape_of(value)
    parts = [reshape(part(value), (*shape, 1)) for part in (hlo.real, hlo.imag)]
    return concatenate(parts, len(shape))


def from_float_pairs(value: ir.Value) -> ir.Value:
    """Floats with a trailing dimension of 2 as one complex tensor: ``view_as_complex``."""
    shape = shape_of(value)
    last = len(shape) - 1
    real, imaginary = (reshape(slice_along(value, last, i, i + 1), shape[:-1]) for i in (0, 1))
    return hlo.complex(real, imaginary)
