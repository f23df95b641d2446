"""Marking the arguments of AOTAutograd's graphs that their programs may take over (see ``donation_marks``).

AOTAutograd knows both facts the marks need: which saved values are the forward's own intermediates
(``bw_donated_idxs``: not an input, an output or a gradient, so no user or other graph can see them), and which
arguments a graph updates in place (their new values are its first outputs, in argument order).
"""

from __future__ import annotations

import torch
import torch.fx

from tpucompile.contracts.donation_marks import DONATABLE, SAVED, SAVED_ON_DEVICE


def mark_donatable(gm: torch.fx.GraphModule, role: str, saved_on_device: bool = False) -> int:
    """Mark ``gm``'s donatable placeholders for ``role`` ("inference", "forward" or "backward") from the
    AOTAutograd metadata of the graph being compiled; returns how many were marked."""
    context = torch._guards.TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None)
    if metadata is None:
        return 0
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    marked = 0
    if role == "backward":
        gm.meta[SAVED_ON_DEVICE] = saved_on_device
        for index in metadata.bw_donated_idxs or ():
            if index < len(placeholders) and _is_tensor(placeholders[index]):
                placeholders[index].meta[DONATABLE] = SAVED
                marked += 1
        return marked
    outputs = gm.graph.output_node().args[0]
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    updated = list(metadata.mutated_inp_runtime_indices)
    for output, index in enumerate(updated):
        info = metadata.input_info[index]
        if (not info.mutates_data or info.mutates_metadata or info.mutates_storage_metadata
                or index >= len(placeholders) or output >= len(outputs)):
            continue
        argument, new_value = placeholders[index], outputs[output]
        if _is_tensor(argument) and _same_layout(argument, new_value) and new_value is not argument:
            argument.meta[DONATABLE] = output
            marked += 1
    return marked


def _is_tensor(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _same_layout(argument: torch.fx.Node, new_value: object) -> bool:
    old = argument.meta.get("val")
    new = getattr(new_value, "meta", {}).get("val")
    return (isinstance(new, torch.Tensor) and new.dtype == old.dtype and new.shape == old.shape)
