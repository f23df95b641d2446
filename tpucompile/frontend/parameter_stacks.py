"""Rolled layers' parameters stacked once, outside the program: each layer's parameter becomes a view of one
buffer that the loop reads as it lies.

The layer roller stacks a run's parameters inside the graph (a concatenation of the layers' values), so every
call of the compiled program copies every rolled weight into a new stack before the loop reads it, and the
backward's gradient of the stack is sliced back into one gradient per layer. Here the concatenation of
parameters that are graph inputs is replaced by one input, the stack itself, and the compiled graph is called
with a buffer whose rows the parameters' ``.data`` are made views of on the first call: an optimiser's
in-place update of a parameter writes into the buffer, so the next call finds it current and passes it again
without a copy. Where gradients flow, the buffers are passed through ``_StackedParts``, whose backward hands
each parameter its row of its stack's gradient as a view, so autograd fills ``.grad`` as before.

A parameter that cannot be a view of a buffer of ours (a view of something else, one that shares its storage,
an inference tensor) is left where it is and stacked by copy on each call, as the program did before; a
parameter whose ``.data`` was replaced since (``load_state_dict(assign=True)``, ``module.to(...)``) is
re-pointed again on the next call. Two models of one class share a compiled graph (their parameters are its
inputs), so a stack keeps one buffer per model. Sharded programs keep the stack in the graph, where the
plan's shardings annotate it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch.utils.weak import WeakIdKeyDictionary

from tpucompile.frontend.layer_rolling import LAYER_STACK_KEY, ROLLING_KEY, graph_copy
from tpucompile.metrics import compile_stats


class _StackedParts(torch.autograd.Function):
    """Each stack's buffer as a function of the parameters that are its rows: forward returns the buffers (no
    copy), backward gives each parameter its row of its stack's gradient (a view). One function for every stack
    of a graph, so a call pays for one autograd node."""

    @staticmethod
    def forward(ctx: Any, held: _Buffers, *parts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.rows = [buffer.shape[0] for buffer in held.buffers]
        return tuple(buffer.detach() for buffer in held.buffers)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        rows: list[Any] = [None]
        for grad, count in zip(grads, ctx.rows, strict=True):
            rows += [None] * count if grad is None else grad.unbind(0)
        return tuple(rows)


@dataclasses.dataclass
class _Buffers:
    """A non-tensor argument of ``_StackedParts`` that carries the buffers (as tensor arguments they would be
    the function's inputs, and returning them would make the outputs views of them)."""

    buffers: list[torch.Tensor]


@dataclasses.dataclass
class ParameterStack:
    """One rolled stack: the outer graph input positions of its layers' parameters, in layer order, and the
    buffer their ``.data`` are views of."""

    positions: tuple[int, ...]
    graph: str
    """The graph's name in ``tpucompile.stats()``, which counts the calls that stacked by copy."""
    buffers: WeakIdKeyDictionary = dataclasses.field(default_factory=WeakIdKeyDictionary)
    """Per model, keyed by its first layer's parameter: the buffer, and where each of its rows starts (a
    parameter at its row's address is that row: Dynamo's guards hold its shape, strides and dtype to the
    compiled graph's). An entry lives as long as that parameter does, never longer (Dynamo keeps a compiled
    graph, and this stack, for the life of the process)."""

    def current(self, args: Sequence[Any]) -> torch.Tensor:
        """The stack for a call with the outer ``args``: the buffer the parameters are views of, re-pointing
        them first where they are not (a copy on that call only), or a copy where they cannot be."""
        first = args[self.positions[0]]
        buffer, addresses = self.buffers.get(first, (None, ()))
        if buffer is not None and all(args[k].data_ptr() == address
                                      for k, address in zip(self.positions, addresses, strict=True)):
            return buffer
        parts = [args[k] for k in self.positions]
        with torch.no_grad():
            stacked = torch.stack([part.detach() for part in parts])
        compile_stats.record_stack_copy(self.graph)
        if all(_re_pointable(part, buffer) for part in parts):
            for row, part in enumerate(parts):
                part.data = stacked[row]
            self.buffers[first] = (stacked, tuple(part.data_ptr() for part in parts))
        return stacked


def _re_pointable(part: torch.Tensor, ours: torch.Tensor | None) -> bool:
    """Whether ``part``'s ``.data`` may become a view of a buffer of ours: a leaf of a plain tensor type, not
    on the meta device, that owns its whole storage or lies in our previous buffer (nothing else can see the
    memory it leaves)."""
    if type(part) not in (torch.Tensor, torch.nn.Parameter) or part.grad_fn is not None or part.is_inference():
        return False
    if part.is_meta or part._base is not None:
        return False
    storage = part.untyped_storage()
    if ours is not None and storage.data_ptr() == ours.untyped_storage().data_ptr():
        return True
    return storage.nbytes() == part.numel() * part.element_size() and part.is_contiguous()


@dataclasses.dataclass
class StackedInputs:
    """How the graph's inputs changed: the outer inputs it keeps, in order, then one input per stack."""

    kept: tuple[int, ...]
    stacks: tuple[ParameterStack, ...]
    examples: tuple[Any, ...]
    """Each stack's example value, a fake tensor of Dynamo's trace (so AOTAutograd keeps its sizes static and
    the plan describes it as the plain tensor it stands for): the compile neither copies the weights nor
    re-points them before the graph has compiled."""
    trained: tuple[int, ...]
    """The stacks the graph is compiled to give gradients to (Dynamo's guards hold the grad mode and the
    parameters' ``requires_grad`` to the compile's, so every call of this graph is alike); a frozen stack is
    passed as its buffer alone."""

    def inner_examples(self, example_inputs: Sequence[Any]) -> list[Any]:
        """The compiled graph's example inputs for the outer ``example_inputs``."""
        return [example_inputs[k] for k in self.kept] + list(self.examples)

    def inner(self, args: Sequence[Any]) -> list[Any]:
        """The compiled graph's arguments for a call with the outer ``args``."""
        buffers = [stack.current(args) for stack in self.stacks]
        if self.trained:
            parts = [args[k] for i in self.trained for k in self.stacks[i].positions]
            differentiable = _StackedParts.apply(_Buffers([buffers[i] for i in self.trained]), *parts)
            for i, buffer in zip(self.trained, differentiable, strict=True):
                buffers[i] = buffer
        return [args[k] for k in self.kept] + buffers

    def wrap(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        """``compiled`` (a function of the inner arguments) as a function of the outer ones."""

        def run(*args: Any) -> Any:
            return compiled(*self.inner(args))

        return run


def take_out_parameter_stacks(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str
                              ) -> tuple[torch.fx.GraphModule, StackedInputs] | None:
    """A copy of ``gm`` in which each in-graph stack of the rolled layers' parameters (graph inputs that are
    ``nn.Parameter``\\ s read by nothing else) is a graph input of its own, appended after the others, and how
    to call it, for a compile in the present grad mode; None when there is none. ``name`` is the graph's in
    ``tpucompile.stats()``. ``gm`` itself is Dynamo's graph, whose inputs Dynamo reads back after the compile,
    so it keeps its own."""
    if not any(node.meta.get(LAYER_STACK_KEY) for node in gm.graph.nodes):
        return None
    inner = graph_copy(gm)
    graph = inner.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    position = {node: k for k, node in enumerate(placeholders)}
    found: list[tuple[torch.fx.Node, list[torch.fx.Node], list[torch.fx.Node]]] = []
    for node in graph.nodes:
        if not node.meta.get(LAYER_STACK_KEY):
            continue
        rows = list(node.args[0])
        sources = [row.args[0] if isinstance(row, torch.fx.Node) and row.target is torch.unsqueeze else None
                   for row in rows]
        if all(_stackable(source, row, example_inputs, position) for source, row in zip(sources, rows,
                                                                                           strict=True)):
            found.append((node, rows, sources))
    if not found:
        return None
    last = placeholders[-1]
    stacks, examples, taken, notes = [], [], set(), []
    for stack_node, rows, sources in found:
        with graph.inserting_after(last):
            new = graph.placeholder(f"stacked_{sources[0].name}")
        new.meta.update({k: v for k, v in stack_node.meta.items() if k in ("example_value", "val", "tensor_meta")})
        last = new
        stack_node.replace_all_uses_with(new)
        graph.erase_node(stack_node)
        for row in rows:
            graph.erase_node(row)
        for source in sources:
            graph.erase_node(source)
        stacks.append(ParameterStack(tuple(position[s] for s in sources), name))
        examples.append(stack_node.meta["example_value"])
        taken.update(position[s] for s in sources)
        notes.append(f"stacked once: {sources[0].name} .. {sources[-1].name} ({len(sources)} layers)")
    graph.lint()
    inner.recompile()
    inner.meta[ROLLING_KEY] = [*gm.meta.get(ROLLING_KEY, []), *notes]
    kept = tuple(k for k in range(len(placeholders)) if k not in taken)
    trained = tuple(i for i, example in enumerate(examples) if example.requires_grad) \
        if torch.is_grad_enabled() else ()
    return inner, StackedInputs(kept, tuple(stacks), tuple(examples), trained)


def _stackable(source: Any, row: torch.fx.Node, example_inputs: Sequence[Any],
               position: dict[torch.fx.Node, int]) -> bool:
    """Whether ``source`` (a stacked row's value) is a parameter input read only by its row, which is read
    only by the stack."""
    if not isinstance(source, torch.fx.Node) or source.op != "placeholder" or len(source.users) != 1:
        return False
    if len(row.users) != 1:
        return False
    example = example_inputs[position[source]]
    return isinstance(example, torch.nn.Parameter)
