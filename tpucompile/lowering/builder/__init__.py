"""Small StableHLO building blocks that every lowering rule shares.

Rules never build types, constants, broadcasts or reduce regions by hand; they call these helpers, so that
each piece of PyTorch semantics (how a bool converts, how a comparison treats unsigned ints, how numpy-style
broadcasting aligns dimensions) is written once. Rules import this package, never its modules. All helpers
need an active MLIR context, location and insertion point, which the graph lowering sets up around each rule.
"""

from tpucompile.lowering.builder.complex_parts import (
    as_float_pairs,
    conjugate,
    from_float_pairs,
    from_parts,
    imaginary_part,
    real_part,
)
from tpucompile.lowering.builder.constants import constant, constant_like, dense_constant, iota, scaled
from tpucompile.lowering.builder.dtypes import accumulator_dtype, convert, dtype_of, max_value, min_value
from tpucompile.lowering.builder.elementwise import compare, is_nan, select, trunc
from tpucompile.lowering.builder.gather_scatter import (
    index_coordinates,
    scatter,
    scatter_rows,
    take_along,
    wrap_negative,
)
from tpucompile.lowering.builder.linear import contract_trailing, dot_general, eye
from tpucompile.lowering.builder.reductions import (
    fill_combiner,
    reduce,
    reduce_max,
    reduce_min,
    reduce_sum,
    reduce_window,
    scan,
)
from tpucompile.lowering.builder.shapes import (
    at_least_1d,
    broadcast_in_dims,
    broadcast_to,
    concatenate,
    numel,
    per_dim,
    rank_of,
    reshape,
    shape_of,
    slice_along,
    slice_static,
    transpose,
)

__all__ = [
    "accumulator_dtype",
    "as_float_pairs",
    "at_least_1d",
    "broadcast_in_dims",
    "broadcast_to",
    "compare",
    "concatenate",
    "conjugate",
    "constant",
    "constant_like",
    "contract_trailing",
    "convert",
    "dense_constant",
    "dot_general",
    "dtype_of",
    "eye",
    "fill_combiner",
    "from_float_pairs",
    "from_parts",
    "imaginary_part",
    "index_coordinates",
    "iota",
    "is_nan",
    "max_value",
    "min_value",
    "numel",
    "per_dim",
    "rank_of",
    "real_part",
    "reduce",
    "reduce_max",
    "reduce_min",
    "reduce_sum",
    "reduce_window",
    "reshape",
    "scaled",
    "scan",
    "scatter",
    "scatter_rows",
    "select",
    "shape_of",
    "slice_along",
    "slice_static",
    "take_along",
    "transpose",
    "trunc",
    "wrap_negative",
]
