"""Remove ops that return their input unchanged: same-shape views and expands, identity permutations,
full slices, clones, aliases and same-dtype casts, and scatters into a whole dimension (their source). Fewer
nodes means less to lower and to key on."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

aten = torch.ops.aten

_SAME_SHAPE_VIEWS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.expand.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
}
_ALWAYS_IDENTITY = {
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten.lift_fresh_copy.default,
}


def _size_key(size: Any) -> Any:
    """A guard-free comparison key for an int or SymInt size."""
    if isinstance(size, torch.SymInt):
        return ("sym", str(size.node.expr))
    return ("int", int(size))


def _same_type(a: Any, b: Any) -> bool:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    return a.dtype == b.dtype and [_size_key(s) for s in a.shape] == [_size_key(s) for s in b.shape]


def _is_noop(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    if node.args[0].op == "placeholder" and any(user.op == "output" for user in node.users):
        return False  # the graph returns a fresh tensor here; dropping the copy would alias an input
    source = node.args[0].meta.get("val")
    result = node.meta.get("val")
    if not _same_type(source, result):
        return False
    target = node.target
    if target in _ALWAYS_IDENTITY or target in _SAME_SHAPE_VIEWS:
        return True
    if target is aten.permute.default:
        dims = list(node.args[1])
        return dims == list(range(len(dims)))
    if target is aten._to_copy.default:
        return set(node.kwargs) <= {"dtype", "layout", "device", "memory_format", "non_blocking"}
    if target is aten.slice.Tensor:
        step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
        return step == 1
    return False


def _replaces_everything(node: torch.fx.Node) -> bool:
    """A ``slice_scatter`` whose source has the operand's shape: the slice is the whole dimension, so the
    result is the source (the backward of a full slice, e.g. ``x[:, -w:]`` on a sequence no longer than
    ``w``, as Hugging Face's sliding-window caches take it)."""
    if node.op != "call_function" or node.target is not aten.slice_scatter.default or len(node.args) < 2:
        return False
    operand, source = node.args[0], node.args[1]
    if not isinstance(operand, torch.fx.Node) or not isinstance(source, torch.fx.Node):
        return False
    if source.op == "placeholder" and any(user.op == "output" for user in node.users):
        return False  # the graph returns a fresh tensor here; dropping the write would alias an input
    step = node.args[5] if len(node.args) > 5 else node.kwargs.get("step", 1)
    return (step == 1 and _same_type(operand.meta.get("val"), source.meta.get("val"))
            and _same_type(source.meta.get("val"), node.meta.get("val")))


def remove_noop_views(gm: torch.fx.GraphModule) -> int:
    """Replace no-op nodes by their input (a whole-dimension ``slice_scatter`` by its source); returns how many
    were removed."""
    removed = 0
    for node in list(gm.graph.nodes):
        replacement = node.args[0] if _is_noop(node) else node.args[1] if _replaces_everything(node) else None
        if replacement is not None:
            node.replace_all_uses_with(replacement)
            gm.graph.erase_node(node)
            removed += 1
    if removed:
        gm.recompile()
    return removed


def is_view(node: torch.fx.Node) -> bool:
    """An op whose result aliases its first argument (its schema says so)."""
    if node.op != "call_function":
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and not alias.is_write
