"""``torch.ops.higher_order.scan`` as a ``stablehlo.while``: rolled layers (``frontend/layer_rolling.py``) and
the reverse loop AOTAutograd makes for their backward.

``scan(body, init, xs, shared)`` runs ``body(*carry, *x[i], *shared) -> (*carry, *y)`` for ``i`` in
``range(len(x))`` and returns the last carry and every ``y`` stacked. The loop carries the counter, the carry
and one buffer per ``y``, which each iteration writes its slice of (``dynamic_update_slice``, in place for
XLA); the stacked inputs and shared values are carried through unchanged, so the body reads its own slice
of each (``dynamic_slice``) without a copy of the stack.

The backward's scan walks the forward's stacked values in reverse (``contracts.loop_ops.scan_in_reverse``,
made from AOTAutograd's flips by ``passes/rolled_loops.py``): the loop reads and writes such a stack at
``length - 1 - i``, so the reversal is an index, not a copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.contracts.loop_ops import TRIPS_PREFIX, body_of, is_loop, loop_parts
from tpucompile.lowering import jax_bridge
from tpucompile.lowering.builder.constants import constant
from tpucompile.lowering.builder.dtypes import dtype_of
from tpucompile.lowering.builder.shapes import reshape, shape_of
from tpucompile.lowering.types import tensor_type

BodyLowering = Callable[[torch.fx.GraphModule, Sequence[ir.Value]], list[ir.Value]]
"""Lowers a body graph's ops on the given argument values (at the current insertion point), returning its
outputs' values."""


def unsupported_in_body(node: torch.fx.Node, reason: Callable[[torch.fx.Node], str | None]) -> str | None:
    """Why a scan cannot be lowered: the first reason ``reason`` gives for an op of its body, else None."""
    for inner in body_of(node).graph.nodes:
        why = reason(inner)
        if why is not None:
            return f"the rolled loop {node.name} holds an op that cannot be lowered: {why}"
    return None


def lower_scan(node: torch.fx.Node, env: dict[torch.fx.Node, Any], lower_body: BodyLowering) -> list[ir.Value]:
    """The results of scan ``node`` (its final carries, then its stacked outputs) as one ``stablehlo.while``."""
    _, init_nodes, xs_nodes, shared_nodes, reversed_xs, reversed_ys = loop_parts(node)
    body = body_of(node)
    inits = [env[n] for n in init_nodes]
    shared = [env[n] for n in shared_nodes]
    xs = [env[n] for n in xs_nodes]
    if not xs:
        raise ValueError(f"scan {node.name} has no stacked input to take its length from")
    length = shape_of(xs[0])[0]
    results = node.meta["val"]
    stacked_outputs = results[len(inits):]
    buffers = [_unwritten(tuple(int(s) for s in out.shape), out.dtype) for out in stacked_outputs]

    counter = constant(0, torch.int64, ())
    operands = [counter, *inits, *buffers, *xs, *shared]
    types = [v.type for v in operands]
    with ir.Location.name(f"{TRIPS_PREFIX}{length}", childLoc=ir.Location.current):
        loop = hlo.WhileOp(types, operands)
    n_carry, n_out, n_x = len(inits), len(buffers), len(xs)

    condition = loop.regions[0].blocks.append(*types)
    with ir.InsertionPoint(condition):
        limit = constant(length, torch.int64, ())
        hlo.return_([hlo.compare(condition.arguments[0], limit, hlo.ComparisonDirectionAttr.get("LT"))])

    step = loop.regions[1].blocks.append(*types)
    with ir.InsertionPoint(step):
        args = list(step.arguments)
        index = args[0]
        carries = args[1:1 + n_carry]
        outs = args[1 + n_carry:1 + n_carry + n_out]
        stacks = args[1 + n_carry + n_out:1 + n_carry + n_out + n_x]
        constants = args[1 + n_carry + n_out + n_x:]
        last = constant(length - 1, torch.int64, ())
        reversed_index = hlo.subtract(last, index)
        slices = [_take(stack, reversed_index if reverse else index)
                  for stack, reverse in zip(stacks, reversed_xs, strict=True)]
        produced = lower_body(body, [*carries, *slices, *constants])
        next_carries, ys = produced[:n_carry], produced[n_carry:]
        written = [_put(buffer, y, reversed_index if reverse else index)
                   for buffer, y, reverse in zip(outs, ys, reversed_ys, strict=True)]
        one = constant(1, torch.int64, ())
        hlo.return_([hlo.add(index, one), *next_carries, *written, *stacks, *constants])
    return list(loop.results[1:1 + n_carry + n_out])


def _unwritten(shape: tuple[int, ...], dtype: torch.dtype) -> ir.Value:
    """A buffer for a loop to write every slice of. On a TPU, XLA's ``AllocateBuffer`` (no write at all: a
    zero fill would write the whole stack once more before the loop, 7 of a rolled forward's 10M estimated
    cycles on a 4-layer decoder); elsewhere, where XLA has no such call, zeros."""
    if jax_bridge.current_platform() != "tpu":
        return constant(0, dtype, shape)
    op = hlo.CustomCallOp([tensor_type(shape, dtype)], [], call_target_name=ir.StringAttr.get("AllocateBuffer"))
    return op.results[0]


def _take(stack: ir.Value, index: ir.Value) -> ir.Value:
    """``stack[index]`` for a traced scalar ``index``."""
    shape = shape_of(stack)
    zero = constant(0, torch.int64, ())
    piece = hlo.dynamic_slice(stack, [index] + [zero] * (len(shape) - 1), [1, *shape[1:]])
    return reshape(piece, shape[1:])


def _put(buffer: ir.Value, value: ir.Value, index: ir.Value) -> ir.Value:
    """``buffer`` with ``buffer[index] = value``."""
    shape = shape_of(buffer)
    zero = constant(0, torch.int64, ())
    if dtype_of(value) != dtype_of(buffer):
        raise TypeError(f"a loop output of {dtype_of(value)} written into a {dtype_of(buffer)} stack")
    return hlo.dynamic_update_slice(buffer, reshape(value, [1, *shape[1:]]), [index] + [zero] * (len(shape) - 1))


def repeated_flops(node: torch.fx.Node) -> float:
    """The matrix-product flops of loop ``node``'s iterations after the first (its body's products, and those of
    loops inside it, times the trip count less one)."""
    _, _, xs, _, _, _ = loop_parts(node)
    trips = int(xs[0].meta["val"].shape[0]) if xs else 1
    return (trips - 1) * product_flops(body_of(node))


def product_flops(body: torch.fx.GraphModule) -> float:
    """The flops of the matrix products and convolutions one run of ``body`` makes (2 per multiply-add), with
    the loops inside it counted per iteration."""
    total = 0.0
    for node in body.graph.nodes:
        if is_loop(node):
            total += repeated_flops(node) + product_flops(body_of(node))
            continue
        packet = getattr(node.target, "overloadpacket", None) if node.op == "call_function" else None
        result = node.meta.get("val")
        if packet is None or not isinstance(result, torch.Tensor):
            continue
        if packet in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm):
            left = node.args[1 if packet in (torch.ops.aten.addmm, torch.ops.aten.baddbmm) else 0].meta["val"]
            total += 2.0 * result.numel() * int(left.shape[-1])
        elif packet is torch.ops.aten.convolution:
            weight = node.args[1].meta["val"]
            total += 2.0 * result.numel() * (weight.numel() // int(weight.shape[0]))
    return total
