"""Remove nodes whose results nobody uses: in functional graphs all of them, in graphs with side effects
(Dynamo's) those a rewrite stopped reading."""

from __future__ import annotations

import operator

import torch.fx


def eliminate_dead_code(gm: torch.fx.GraphModule) -> bool:
    """Drop unused pure nodes; placeholders stay so the calling convention does not change."""
    changed = gm.graph.eliminate_dead_code()
    if changed:
        gm.recompile()
    return changed


def drop_unread(gm: torch.fx.GraphModule, candidates: list[torch.fx.Node]) -> None:
    """Remove ``candidates`` that nothing reads any more, and then their inputs that nothing else reads, in a
    graph that may have side effects (Dynamo's): only calls that are neither impure nor in place go. The
    caller does not recompile."""
    pending, erased = list(candidates), set()
    while pending:
        node = pending.pop()
        if (node in erased or node.op not in ("call_function", "call_method") or node.users
                or _in_place(node) or node.is_impure()):
            continue
        inputs = node.all_input_nodes
        gm.graph.erase_node(node)
        erased.add(node)
        pending.extend(inputs)


def _in_place(node: torch.fx.Node) -> bool:
    """Whether ``node`` may write to its input (``x.add_(y)``, ``torch.relu_``, ``operator.iadd``)."""
    name = str(node.target if node.op == "call_method" else getattr(node.target, "__name__", ""))
    if name.startswith("__"):
        return name.startswith("__i") and name[3:-2] in _AUGMENTED
    if name in ("and_", "or_", "not_"):
        return False
    return name.endswith("_") or (node.target in _IN_PLACE_OPERATORS)


_AUGMENTED = {"add", "sub", "mul", "and", "or", "xor", "truediv", "floordiv", "mod", "lshift", "rshift", "pow",
              "matmul"}
_IN_PLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.iand, operator.ior, operator.ixor,
                       operator.itruediv, operator.ifloordiv, operator.imod, operator.ilshift, operator.irshift,
                       operator.ipow, operator.imatmul, operator.setitem}
