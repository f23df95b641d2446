"""A bucketed program's concatenation that extends an argument, written into the argument's own buffer.

A decoding step appends its new positions to a key/value cache of runtime length and returns the longer
cache: ``cat([cache, new], dim)``. Its bucketed program takes the cache padded past the bucket by the step's
growth (``runtime/padded_results.growing_arguments``), so the returned cache, padded alike, is what the next step
takes. Lowered as it reads, the concatenation copies the whole cache into a new buffer on every step (XLA's
dynamic padder pads the cache's actual part and writes the new positions behind it). Written instead as an
update of the argument's buffer at the cache's actual length, with the argument aliased to that result, XLA
writes only the new positions, in place: the program takes the argument over (donation), which the runtime
does with a cache buffer it owns and with a copy otherwise (``runtime/executable``).

What lies past the actual length in the argument's buffer stays there as padding, which no bucketed program
reads (``dynamic_sizes``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sympy
import torch
import torch.fx
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering import dynamic_sizes
from tpucompile.lowering.builder import constant
from tpucompile.lowering.shapes import ShapeBindings

aten = torch.ops.aten


def concatenations(tensor_inputs: Sequence[tuple[int, torch.fx.Node]], results: Sequence[Any],
                   bindings: ShapeBindings) -> dict[torch.fx.Node, torch.fx.Node]:
    """{concatenation: argument} for each returned ``cat([argument, addition], dim)`` that is the argument's
    only use, where the argument is taken padded past its bucket (``bindings.input_extents``) to exactly the
    concatenation's size at the bucket, and the addition has fixed sizes and the same dtype."""
    extents = bindings.input_extents
    returned = set(results)
    found = {}
    for index, node in tensor_inputs:
        if index not in extents or len(node.users) != 1:
            continue
        (user,) = node.users
        if user.target is not aten.cat.default or user not in returned:
            continue
        tensors = user.args[0]
        if len(tensors) != 2 or tensors[0] is not node or not isinstance(tensors[1], torch.fx.Node):
            continue
        argument, addition, result = node.meta["val"], tensors[1].meta.get("val"), user.meta["val"]
        if (not isinstance(addition, torch.Tensor) or dynamic_sizes.symbolic_dims(addition, bindings.runtime)
                or not argument.dtype == addition.dtype == result.dtype):
            continue
        if tuple(bindings.spec(result).shape) != tuple(extents[index]):
            continue
        found[user] = node
    return found


def lower(node: torch.fx.Node, argument: torch.fx.Node, full: ir.Value, env: Mapping[torch.fx.Node, Any],
          sizes: dynamic_sizes.SizeValues, runtime: frozenset[sympy.Symbol]) -> ir.Value:
    """``node`` (a concatenation ``concatenations`` found) as an update of ``full``, the argument's whole
    buffer, at the argument's actual extent along the concatenated dimension."""
    rank = argument.meta["val"].dim()
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % rank
    # runtime-sized: the argument's headroom is along runtime-sized dimensions only, and the result's size
    # equals it (``concatenations``), so the concatenated dimension is one of them
    start = sizes.of(dict(dynamic_sizes.symbolic_dims(argument.meta["val"], runtime))[dim])
    zero = constant(0, dynamic_sizes.SIZE_DTYPE)
    return hlo.dynamic_update_slice(full, env[node.args[0][1]], [start if d == dim else zero for d in range(rank)])
