"""A transposed view saved for the backward is handed over as its base, and transposed again in the backward;
in a bucketed program, so is a view that merges a runtime-sized dimension into the rows of a matrix.

The min-cut partition may save a transposed view of a forward value instead of the value: the weight gradient
of ``x @ w`` is ``x.t() @ grad``, and the ``t`` node depends on forward values only, so the partition is free
to cut after it. A program returns its results in their default layout, so a saved transpose is written out
as a transposing copy at the end of the forward (a GPT-2 forward of 1B parameters on a v5e: 32 such copies
of its blocks' inputs, 14M estimated cycles). Handing over the base costs no copy, and the view at the top of
the backward becomes the product's dimension numbers there, as in a program that holds forward and backward
together.

A linear layer's input ``(b, s, k)`` is saved as its merged view ``(b*s, k)``, the operand of the weight's
gradient. With ``s`` padded to a bucket, XLA's padder writes that view out with the actual rows packed to the
front (a gather over the whole value at the end of the forward), and the backward's product unpacks nothing
it needs: its operand may as well be the padded base, merged again in the backward, where the bucketed
lowering takes the merge as it is (``lowering/unmerged``).
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten

TRANSPOSING_VIEWS = frozenset({aten.t.default, aten.permute.default, aten.transpose.int, aten.numpy_T.default})
"""Views that only reorder their base's dimensions: the base holds the same elements, in another order."""

PRODUCTS = frozenset({aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default})
"""The backward readers a transposed operand costs nothing in: a matrix product, whose lowering takes any order
of its operand's dimensions as its dimension numbers. Any other reader (the attention kernel's backward, an
elementwise op) would need the data in the view's order, and XLA would write the transposed copy in the
backward instead of the forward."""


MERGING_VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
"""Views that may merge a value's leading dimensions into the rows of a matrix."""


def save_bases_of_transposes(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule,
                             num_forward_outputs: int, runtime_merges: bool = False) -> int:
    """Rewrite a partition in place: each saved output of ``forward`` that is a transposing view (or a chain of
    them; with ``runtime_merges``, also views that merge a value's leading dimensions, one of them symbolic,
    into rows) which only matrix products read in the backward is replaced by the value it views, or dropped
    where that value is saved already, and the backward takes the views of the value's placeholder. A view of
    a graph input, or of a value the forward also returns to its caller, stays. Returns how many saved values
    changed."""
    output = forward.graph.output_node()
    outputs = list(output.args[0])
    saved = {value for value in outputs[num_forward_outputs:] if isinstance(value, torch.fx.Node)}
    returned = {value for value in outputs[:num_forward_outputs] if isinstance(value, torch.fx.Node)}
    backward_nodes = {node.name: node for node in backward.graph.nodes}
    first_body_node = next((n for n in backward.graph.nodes if n.op != "placeholder"), None)
    if first_body_node is None:
        return 0
    kept, changed = list(outputs[:num_forward_outputs]), 0
    for view in outputs[num_forward_outputs:]:
        base, views = _transposed_base(view, runtime_merges)
        placeholder = backward_nodes.get(view.name) if base is not None else None
        if (placeholder is None or placeholder.op != "placeholder" or base in returned
                or not all(reader.target in PRODUCTS for reader in placeholder.users)):
            kept.append(view)
            continue
        if base in saved:  # the base crosses already: the views are taken of its placeholder
            base_placeholder = backward_nodes.get(base.name)
            if base_placeholder is None or base_placeholder.op != "placeholder":
                kept.append(view)
                continue
            _views_of(backward, base_placeholder, views, placeholder, first_body_node)
            backward.graph.erase_node(placeholder)
            del backward_nodes[view.name]
        elif base.op == "placeholder":  # an input not saved as it is stays behind its view: the caller may
            kept.append(view)  # change it in place before the backward runs
            continue
        else:
            clash = backward_nodes.pop(base.name, None)
            if clash is not None:  # a backward value of the same name: renamed, the name is the saved value's
                clash._rename(f"{clash.name}_backward")
                backward_nodes[clash.name] = clash
            _rename_to_base(placeholder, base)
            del backward_nodes[view.name]
            backward_nodes[placeholder.name] = placeholder
            _views_of(backward, placeholder, views, placeholder, first_body_node)
            kept.append(base)
            saved.add(base)
        changed += 1
    if not changed:
        return 0
    output.args = (tuple(kept), *output.args[1:])
    for view in reversed([node for node in forward.graph.nodes
                          if node.target in TRANSPOSING_VIEWS or node.target in MERGING_VIEWS]):
        if not view.users:
            forward.graph.erase_node(view)
    forward.recompile()
    backward.recompile()
    return changed


def _transposed_base(node: object, runtime_merges: bool = False) -> tuple[torch.fx.Node | None, list[torch.fx.Node]]:
    """The value ``node`` transposes (or, with ``runtime_merges``, merges into rows: ``_merges_runtime_rows``)
    through one or more views of one dtype, and those views from the value out; (None, []) when ``node`` is
    no such view."""
    views = []
    while (isinstance(node, torch.fx.Node) and node.op == "call_function"
           and (node.target in TRANSPOSING_VIEWS or (runtime_merges and _merges_runtime_rows(node)))
           and isinstance(node.args[0], torch.fx.Node)
           and not node.meta.get("saved_tensor_with_no_vc_check", False)):  # AOTAutograd keeps these last
        value, base_value = node.meta.get("val"), node.args[0].meta.get("val")
        if not isinstance(value, torch.Tensor) or not isinstance(base_value, torch.Tensor) or (
                base_value.dtype != value.dtype):
            break
        views.append(node)
        node = node.args[0]
    return (node, views[::-1]) if views else (None, [])


def _merges_runtime_rows(node: torch.fx.Node) -> bool:
    """Whether ``node`` views a contiguous value of shape ``(d0, ..., dn, k)`` as ``(d0 * ... * dn, k)`` with a
    symbolic row count: the view the backward can take again as ``view(-1, k)`` of the value's placeholder."""
    if node.target not in MERGING_VIEWS or not isinstance(node.args[0], torch.fx.Node):
        return False
    value, base = node.meta.get("val"), node.args[0].meta.get("val")
    if not isinstance(value, torch.Tensor) or not isinstance(base, torch.Tensor) or value.dim() != 2 or (
            base.dim() < 3 or not isinstance(base.shape[-1], int) or value.shape[1] != base.shape[-1]):
        return False
    rows = value.shape[0]
    return isinstance(rows, torch.SymInt) and statically_known_true(base.is_contiguous())


def _rename_to_base(placeholder: torch.fx.Node, base: torch.fx.Node) -> None:
    """Make the backward's ``placeholder`` its input for ``base``: the forward's name and value."""
    placeholder._rename(base.name)
    placeholder.target = placeholder.name
    placeholder.meta = {key: value for key, value in base.meta.items() if key in _VALUE_META}


def _views_of(backward: torch.fx.GraphModule, base: torch.fx.Node, views: list[torch.fx.Node],
              readers_of: torch.fx.Node, before: torch.fx.Node) -> None:
    """Give the readers of ``readers_of`` the forward's ``views`` taken of the backward's ``base`` instead."""
    value, made = base, set()
    with backward.graph.inserting_before(before):
        for view in views:
            if view.target in MERGING_VIEWS:  # its sizes are the forward's: the rows are inferred again here
                value = backward.graph.call_function(aten.view.default, (value, [-1, view.meta["val"].shape[1]]))
            else:
                value = backward.graph.call_function(view.target, (value, *view.args[1:]), dict(view.kwargs))
            value.meta = {key: meta for key, meta in view.meta.items() if key in _VALUE_META}
            made.add(value)
    readers_of.replace_all_uses_with(value, delete_user_cb=lambda user: user not in made)


_VALUE_META = ("val", "tensor_meta")
