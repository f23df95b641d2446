"""``F.linear_cross_entropy``'s batch-chunked custom ops (``torch_nn::_linear_cross_entropy_batch_chunked*``).

PyTorch computes ``cross_entropy(input @ linear_weight.T + linear_bias, target)`` there in batch chunks to bound
its memory, and the scalar-reduction op returns its gradients along with the loss. Chunking is a memory
schedule, not a different result, so both ops lower to the plain computation over the whole batch, which XLA
fuses: with ``logp = log_softmax(logits)`` and ``w[n]`` the class weight of row n's target (0 for ignored
rows), the per-row loss is ``-w[n] * logp[n, target[n]]``, the reduced loss its sum (divided by ``sum(w)`` for
``mean``), and the gradient with respect to the logits ``G = s * (onehot(target) - softmax) * w[:, None]``
with ``s = -1`` (sum) or ``-1 / sum(w)`` (mean), from which ``grad_input = G @ linear_weight``,
``grad_linear_weight = G.T @ input`` and ``grad_linear_bias = G.sum(0)``. bfloat16/float16 inputs are
computed in float32 (the ops' ``acc_dtype``).
"""

from __future__ import annotations

import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.errors import UnsupportedOpError
from tpucompile.lowering import builder
from tpucompile.lowering.registry import register_rule

Value = ir.Value


class _Problem:
    """The shared part of both ops: logits, log-softmax, the one-hot targets and the per-row class weight."""

    def __init__(self, x, linear_weight, target, linear_bias, weight, ignore_index):
        self.dtype = builder.accumulator_dtype(builder.dtype_of(x))
        work = self.dtype
        self.x = builder.convert(x, work)
        self.linear_weight = builder.convert(linear_weight, work)
        rows = builder.shape_of(x)[0]
        classes = builder.shape_of(linear_weight)[0]
        self.shape = (rows, classes)
        logits = builder.dot_general(self.x, self.linear_weight, ((1,), (1,)))
        if linear_bias is not None:
            logits = hlo.add(logits, builder.broadcast_in_dims(builder.convert(linear_bias, work), self.shape, [1]))
        shifted = hlo.subtract(logits, builder.broadcast_in_dims(builder.reduce_max(logits, [1]), self.shape, [0]))
        exp = hlo.exponential(shifted)
        denominator = builder.reduce_sum(exp, [1])
        self.softmax = hlo.divide(exp, builder.broadcast_in_dims(denominator, self.shape, [0]))
        self.log_softmax = hlo.subtract(shifted, builder.broadcast_in_dims(hlo.log(denominator), self.shape, [0]))
        target = builder.convert(target, torch.int64)
        ignored = builder.compare(target, builder.constant(ignore_index, torch.int64, (rows,)), "EQ")
        classes_iota = builder.iota(self.shape, torch.int64, 1)
        self.onehot = builder.convert(
            builder.compare(classes_iota, builder.broadcast_in_dims(target, self.shape, [0]), "EQ"), work
        )
        if weight is None:
            row_weight = builder.constant(1, work, (rows,))
        else:
            class_weight = builder.broadcast_in_dims(builder.convert(weight, work), self.shape, [1])
            row_weight = builder.reduce_sum(hlo.multiply(self.onehot, class_weight), [1])
        self.row_weight = builder.select(ignored, builder.constant(0, work, (rows,)), row_weight)

    def row_losses(self) -> Value:
        picked = builder.reduce_sum(hlo.multiply(self.onehot, self.log_softmax), [1])
        return hlo.negate(hlo.multiply(self.row_weight, picked))


try:
    import torch.nn.modules.linear_cross_entropy  # registers the torch_nn ops

    _OPS = [torch.ops.torch_nn._linear_cross_entropy_batch_chunked.default,
            torch.ops.torch_nn._linear_cross_entropy_batch_chunked_no_reduction.default]
except (ImportError, AttributeError):  # a PyTorch without the chunked ops
    _OPS = []


def _chunked(ctx, x, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing,
             batch_chunk_size, acc_policy, acc_dtype, allow_retain_graph, compute_input_grad,
             compute_linear_weight_grad, compute_linear_bias_grad):
    if label_smoothing:
        raise UnsupportedOpError("linear_cross_entropy with label smoothing is not supported (nor by PyTorch)")
    if reduction not in ("mean", "sum"):
        raise UnsupportedOpError(f"linear_cross_entropy (chunked) with reduction={reduction!r} is not supported")
    problem = _Problem(x, linear_weight, target, linear_bias, weight, ignore_index)
    work = problem.dtype
    loss = builder.reduce_sum(problem.row_losses(), [0])
    scale = builder.constant(-1, work)
    if reduction == "mean":
        total = builder.reduce_sum(problem.row_weight, [0])
        loss = hlo.divide(loss, total)
        scale = hlo.divide(scale, total)  # NaN when every row is ignored, as eager
    row_scale = hlo.multiply(builder.broadcast_to(scale, (problem.shape[0],)), problem.row_weight)
    grad_logits = hlo.multiply(hlo.subtract(problem.onehot, problem.softmax),
                               builder.broadcast_in_dims(row_scale, problem.shape, [0]))
    loss_spec, input_spec, weight_spec, bias_spec = ctx.avals_out
    results = [builder.convert(loss, loss_spec.dtype)]
    if compute_input_grad:
        grad = builder.dot_general(grad_logits, problem.linear_weight, ((1,), (0,)))
        results.append(builder.convert(grad, input_spec.dtype))
    else:
        results.append(builder.constant(0, input_spec.dtype, input_spec.shape))
    if compute_linear_weight_grad:
        grad = builder.dot_general(grad_logits, problem.x, ((0,), (0,)))
        results.append(builder.convert(grad, weight_spec.dtype))
    else:
        results.append(builder.constant(0, weight_spec.dtype, weight_spec.shape))
    if compute_linear_bias_grad:
        results.append(builder.convert(builder.reduce_sum(grad_logits, [0]), bias_spec.dtype))
    else:
        results.append(builder.constant(0, bias_spec.dtype, bias_spec.shape))
    return results


def _chunked_no_reduction(ctx, x, linear_weight, target, linear_bias, weight, ignore_index, batch_chunk_size,
                          acc_policy, acc_dtype):
    problem = _Problem(x, linear_weight, target, linear_bias, weight, ignore_index)
    return builder.convert(problem.row_losses(), ctx.aval_out.dtype)


if _OPS:
    register_rule(_OPS[0])(_chunked)
    register_rule(_OPS[1])(_chunked_no_reduction)
