"""Warm starts without AOTAutograd: what AOTAutograd made of a Dynamo graph, cached as a plan.

On a cold start AOTAutograd traces Dynamo's graph (functionalisation, decompositions, and for training the
joint graph and its partition into forward and backward), which costs about as much as Dynamo's own trace.
Its output is then lowered and compiled. On a warm start the programs and executables come from the cache,
but the trace would still run, only to find the same graphs again. This module skips it.

A **plan** records, for one Dynamo graph, the program cache keys of the graphs AOTAutograd produced and how
to call them: for inference one program that takes Dynamo's arguments and returns its outputs; for training
a forward that returns the new values of the arguments it updates in place, the outputs and the tensors saved
for the backward, and a backward that takes the saved tensors and the gradients of the differentiable outputs
and returns one gradient per argument. The runner copies the new values into those arguments, as
AOTAutograd's wrapper does (BatchNorm's running statistics in training).
Plans are plain JSON entries of the persistent cache (kind ``plan``), keyed by a canonical encoding of the
Dynamo graph, a digest of its nodes' source lines (the programs carry them, as in the program layer), its
example arguments (dtype, shape, strides, ``requires_grad``), the process-wide torch state that changes what
AOTAutograd makes of the graph (grad and inference modes, autocast, the default dtype, deterministic
algorithms, every ``torch._functorch.config`` setting, the decomposition table), the options, torch's
version and the environment of the other layers.

Only graphs whose AOTAutograd wrappers do nothing but call the compiled graph (and copy updated values into
arguments) get a plan: in-place updates only of the values of arguments that need no gradient, and only in
training graphs (inference graphs keep them inside the program); no outputs aliasing inputs, none aliasing
intermediates other than a view of one the graph does not return (AOTAutograd hides that aliasing from
autograd, ``unsafe_view_alias``, and our programs' results are fresh tensors already), no effect tokens, no
tensor subclasses, no symbolic sizes, no duplicated arguments, a single compiled region per graph, no
compile-only targets, no mesh. Everything else takes the ordinary path, as does
every graph while a dump is recording (dumps show AOTAutograd's graphs).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

from tpucompile import artifacts, driver
from tpucompile.config import Options
from tpucompile.lowering import ShapeBindings, custom_ops
from tpucompile.runtime import GraphExecutable

log = logging.getLogger("tpucompile")

PLAN_SCHEMA = 3
_ROLE_ORDER = ("inference", "forward", "backward")


def plan_components(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: Options, targets: driver.CompileTargets
) -> dict[str, Any] | None:
    """The key components of ``gm``'s plan for ``targets`` (this process's device), or None when ``gm`` cannot
    have one (see the module doc)."""
    if not example_inputs or not all(isinstance(x, torch.Tensor) for x in example_inputs):
        return None
    if options.targets or options.mesh is not None:  # compile-only targets and sharded programs start from
        return None  # the ATen graphs (and sharded runs from their own executables): let AOTAutograd make them
    if any(map(_is_symbolic, example_inputs)) or not _plain_and_distinct(example_inputs):
        return None
    try:
        graph, locations = artifacts.encode_graph(gm, ShapeBindings(), values=False)
    except artifacts.Uncacheable as why:
        log.debug("tpucompile: no plan for this graph (%s)", why)
        return None
    settings = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
                if not f.name.startswith("cache_")}
    return {
        "kind": "plan",
        "schema": PLAN_SCHEMA,
        "graph": graph,
        "locations": locations,  # the programs carry the user's lines
        "inputs": [_describe(x) for x in example_inputs],
        "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "autocast": [torch.is_autocast_enabled("cpu"), str(torch.get_autocast_dtype("cpu"))],
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic": [torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()],
        "functorch_config": _functorch_settings(),
        "decompositions": _table_digest(driver.decompositions_for(targets, options)),
        # every one, not only those of this graph's ops: the backward's ops (a custom op's autograd formula may
        # call another) show only in the ATen graphs, whose programs the plan names by key
        "jax_lowerings": custom_ops.registrations(targets.lowered_for.platform),
        "options": {k: v if isinstance(v, (bool, int, float, str, type(None))) else repr(v)
                    for k, v in sorted(settings.items())},
        **artifacts.environment(targets.lowered_for),
    }


def _functorch_settings() -> dict[str, Any]:
    """Every setting of ``torch._functorch.config`` as AOTAutograd sees it now (the backend calls this inside
    its own patches): the partitioner's (what a forward saves for its backward), functionalisation's and the
    rest all change the graphs a plan records. Callables (a custom joint pass) are named by where they are
    defined; other values that are not plain JSON by their ``repr``."""
    values = torch._functorch.config.get_config_copy()
    return {name: _plain(value) for name, value in sorted(values.items())
            if name not in ("_save_config_ignore", "TYPE_CHECKING")}


def _plain(value: Any) -> Any:
    """``value`` as the same JSON in every process: callables by where they are defined (``functools.partial``
    by its function and arguments), other objects by their ``repr`` without memory addresses."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch._ops.OpOverload):
        return str(value)
    if isinstance(value, functools.partial):
        arguments = [*map(_plain, value.args), *(f"{k}={_plain(v)}" for k, v in sorted(value.keywords.items()))]
        return f"partial({_plain(value.func)}, {', '.join(map(str, arguments))})"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return _ADDRESS.sub("", repr(value))


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_table_digests: dict[int, tuple[int, str]] = {}


def _table_digest(table: dict[Any, Callable[..., Any]]) -> str:
    """The identity of the decomposition table AOTAutograd traces with: each op it decomposes and the function
    it decomposes it with (a decomposition registered at run time, or an op that appears later, such as
    ``prims.fma``, changes it). Memoised per table object and size."""
    memo = _table_digests.get(id(table))
    if memo is not None and memo[0] == len(table):
        return memo[1]
    entries = sorted(f"{op}={_plain(fn)}" for op, fn in table.items())
    text = hashlib.sha256("\n".join(entries).encode()).hexdigest()
    _table_digests[id(table)] = (len(table), text)
    return text


def runs_direct(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: Options) -> bool:
    """Whether ``gm``, an inference graph with symbolic sizes, may run without AOTAutograd's wrapper once its
    program is compiled (checked again against AOTAutograd's metadata when it is): a plan kept in this process
    only, since a warm start needs AOTAutograd's graph to compile each new bucket or size."""
    if options.compile_only or options.targets or options.mesh is not None or not example_inputs:
        return False
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    sizes = sum(isinstance(x, torch.SymInt) for x in example_inputs)
    if len(tensors) + sizes != len(example_inputs) or not _plain_and_distinct(tensors):
        return False
    if not sizes and not any(map(_is_symbolic, tensors)):
        return False
    return not (torch.is_grad_enabled() and any(x.requires_grad for x in tensors))


def _plain_and_distinct(tensors: Sequence[torch.Tensor]) -> bool:
    """Plain tensors and parameters (no subclasses), each passed once: AOTAutograd's wrapper would unwrap
    subclasses and dedupe repeated arguments. A fake tensor of the trace stands for a plain tensor made at
    call time (a rolled run's stacked parameters, ``frontend/parameter_stacks.py``)."""
    return (all(type(x) in (torch.Tensor, torch.nn.Parameter, FakeTensor) for x in tensors)
            and len({id(x) for x in tensors}) == len(tensors))


def _is_symbolic(tensor: torch.Tensor) -> bool:
    return any(isinstance(s, torch.SymInt) for s in (*tensor.shape, *tensor.stride()))


def _describe(tensor: torch.Tensor) -> list[Any]:
    return [str(tensor.dtype), list(tensor.shape), list(tensor.stride()), tensor.requires_grad,
            str(tensor.device.type)]


# -- recording a plan on a cold start --------------------------------------------------------------------


class PlanRecorder:
    """Collects what the compilers AOTAutograd calls produced, and stores the plan once it is complete."""

    def __init__(self, components: dict[str, Any] | None, tiers: artifacts.ArtifactTiers, input_count: int) -> None:
        self.components = components
        """The plan's key components; None for a symbolic inference graph's plan, kept in this process only
        (``runs_direct``)."""
        self.tiers = tiers
        self.input_count = input_count
        self.roles: dict[str, dict[str, Any]] = {}
        self.start = time.perf_counter()
        self.abandoned = False
        self.executables: dict[str, GraphExecutable] = {}
        self.runner: Callable[..., Any] | None = None
        """The plan's runner, once the plan is complete: what a warm start would run."""

    def take_over(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        """``compiled`` (AOTAutograd's callable) until the plan is complete, then the plan's runner, so a
        process that traced the graph runs its steps as a warm start does (for training, from the call after
        the first backward, which is when AOTAutograd compiles the backward)."""

        def run(*args: Any) -> Any:
            runner = self.runner
            return compiled(*args) if runner is None else runner(*args)

        return run

    def record(self, role: str, gm: torch.fx.GraphModule, compiled: Any) -> None:
        """Note the graph AOTAutograd compiled for ``role`` and what tpucompile made of it."""
        if self.abandoned:
            return
        why = self._unplannable(role, gm, compiled)
        if why is not None:
            log.debug("tpucompile: no plan for this graph (%s)", why)
            self.abandoned = True
            return
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        outputs = _outputs(gm)
        entry: dict[str, Any] = {"program": getattr(compiled, "program_key", None), "inputs": len(placeholders),
                                 "outputs": len(outputs)}
        if role in ("inference", "forward"):
            metadata = torch._guards.TracingContext.get().fw_metadata
            entry["returns"] = metadata.num_forward_returns
            entry["updated"] = list(metadata.mutated_inp_runtime_indices)
            entry["differentiable"] = [bool(o.requires_grad) for o in metadata.output_info]
        else:
            entry["tangents"] = sum(1 for n in placeholders if n.name.startswith("tangents"))
        self.roles[role] = entry
        self.executables[role] = compiled
        if role == "inference" or role == "backward":
            self._store()

    def _unplannable(self, role: str, gm: torch.fx.GraphModule, compiled: Any) -> str | None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if self.components is None:  # symbolic sizes: the graph's own dispatcher, and only for inference
            if role != "inference" or not getattr(compiled, "_boxed_call", False):
                return "symbolic sizes outside an inference graph"
            if not all(isinstance(n.meta.get("val"), (torch.Tensor, torch.SymInt)) for n in placeholders):
                return "graph inputs other than tensors and sizes"
        elif not isinstance(compiled, GraphExecutable) or compiled.program_key is None:
            return "not a single static program"
        elif not all(isinstance(n.meta.get("val"), torch.Tensor) for n in placeholders):
            return "non-tensor graph inputs"
        if role == "backward":
            return None
        context = torch._guards.TracingContext.try_get()
        metadata = getattr(context, "fw_metadata", None)
        if metadata is None:
            return "no AOTAutograd metadata"
        if len(placeholders) != self.input_count:
            return "AOTAutograd changed the arguments"
        mutated = [i for i, info in enumerate(metadata.input_info) if info.mutates_data or info.mutates_metadata]
        if mutated and role == "inference":
            return "input mutations in an inference graph"
        if any(_not_a_plain_update(metadata.input_info[i]) for i in mutated):
            return "input mutations other than value updates of arguments that need no gradient"
        if list(metadata.mutated_inp_runtime_indices) != mutated or (
                metadata.num_forward_returns != len(mutated) + len(metadata.output_info)):
            return "updated arguments not returned first"
        updated_arguments = {placeholders[i] for i in mutated}
        if any(o in updated_arguments for o in _outputs(gm)[len(mutated):]):
            return "an updated argument is also returned or saved"
        if metadata.num_intermediate_bases or metadata.tokens or metadata.num_backward_tokens:
            return "aliased intermediates or effect tokens"
        if metadata.num_symints_saved_for_bw or metadata.num_opaque_objects_saved_for_bw:
            return "sizes or objects saved for the backward"
        if metadata.is_rng_op_functionalized or metadata.num_outputs_rng_offset:
            return "functionalised random state"
        if any(o.output_type.name not in _PLAIN_OUTPUTS or not issubclass(o.raw_type, torch.Tensor)
               for o in metadata.output_info):
            return "outputs that alias or are not tensors"
        if any(type(m).__name__ != "PlainTensorMeta" for m in metadata.subclass_inp_meta or []):
            return "tensor subclasses"
        return None

    def _store(self) -> None:
        if "backward" in self.roles and "forward" not in self.roles:
            return
        plan = {"mode": "inference" if "inference" in self.roles else "training", "roles": self.roles}
        if plan["mode"] == "training":
            forward, backward = self.roles["forward"], self.roles["backward"]
            saved = forward["outputs"] - forward["returns"]
            if backward["inputs"] != saved + backward["tangents"] or backward["outputs"] != self.input_count:
                log.debug("tpucompile: no plan for this graph (unexpected backward signature)")
                return
            if backward["tangents"] != sum(forward["differentiable"]):
                log.debug("tpucompile: no plan for this graph (tangents do not match differentiable outputs)")
                return
            self.runner = _training_runner(self.roles, self.executables["forward"], self.executables["backward"])
        else:
            self.runner = _inference_runner(self.executables["inference"])
        if self.components is not None:
            artifacts.store_plan(self.components, plan, time.perf_counter() - self.start, self.tiers)


_PLAIN_OUTPUTS = ("non_alias", "unsafe_view_alias")
"""AOTAutograd's output kinds whose runtime handling is nothing beyond returning the program's result."""


def _not_a_plain_update(info: Any) -> bool:
    """Whether an argument's mutation needs more of AOTAutograd's wrapper than a ``copy_`` of its new value:
    changed sizes or storage, or an argument autograd must see updated."""
    return bool(info.mutates_metadata or info.mutates_storage_metadata or info.mutation_inductor_storage_resize
                or info.requires_grad or info.keep_input_mutations)


def _outputs(gm: torch.fx.GraphModule) -> list[Any]:
    outputs = gm.graph.output_node().args[0]
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


# -- running a plan on a warm start ------------------------------------------------------------------------


def compiled_from_plan(components: dict[str, Any], options: Options, name: str, targets: driver.CompileTargets
                       ) -> Callable[..., Any] | None:
    """The callable Dynamo needs for the graph of ``components``, built from a cached plan; None without one."""
    found = artifacts.load_plan(components, targets.tiers)
    if found is None:
        return None
    plan, _ = found
    try:
        executables = {
            role: driver.load_compiled_graph(entry["program"], options, f"{name} ({role})", targets)
            for role, entry in sorted(plan["roles"].items(), key=lambda item: _ROLE_ORDER.index(item[0]))
        }
    except (KeyError, ValueError, TypeError):  # a plan of another shape than this version writes
        return None
    if any(e is None for e in executables.values()):
        return None
    if plan["mode"] == "inference":
        return _inference_runner(executables["inference"])
    return _training_runner(plan["roles"], executables["forward"], executables["backward"])


def _inference_runner(executable: GraphExecutable) -> Callable[..., Any]:
    def run(*args: Any) -> list[Any]:
        return executable(list(args))

    return run


def _training_runner(
    roles: dict[str, dict[str, Any]], forward: GraphExecutable, backward: GraphExecutable
) -> Callable[..., Any]:
    """An autograd.Function over the forward and backward programs, as AOTAutograd's is for plain graphs.

    The values the forward saves that its program computed stay device buffers (a torch tensor per value
    costs an export in the forward and a lookup in the backward). They travel to the backward on
    a zero-size tensor passed to ``save_for_backward``, so that autograd frees them when it frees saved
    tensors: after the backward unless the graph is retained. Saved arguments (weights) are saved as the
    tensors they are, so autograd still catches in-place changes to them before the backward; under saved
    tensor hooks (offloading, checkpointing helpers) every saved value is a tensor, for the hooks to see.
    The backward program takes the saved device buffers over (donation) when autograd will not call it again.
    """
    returns = roles["forward"]["returns"]
    differentiable = roles["forward"]["differentiable"]
    updated = roles["forward"]["updated"]
    first_output = len(updated)
    saved_kinds = [slot.kind if slot.part is None else "part" for slot in forward.output_plan[returns:]]
    computed_slots = [i for i, kind in enumerate(saved_kinds) if kind == "result"]
    argument_slots = [i for i, kind in enumerate(saved_kinds) if kind != "result"]
    # Compiled autograd traces the backward of Python autograd.Functions with Dynamo: the program call is
    # opaque to it, as AOTAutograd's compiled backward is (traced, its resident-buffer lookups would guard
    # on tensor ids and recompile every step).
    run_backward = torch._dynamo.disable(_last_reader_call(backward), reason="tpucompile runs the backward program")

    class CompiledGraph(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *args: Any) -> tuple[Any, ...]:
            keep = bool(computed_slots) and not _saved_tensor_hooks_active()
            results = forward.call_keeping(list(args), returns) if keep else forward(list(args))
            for index, value in zip(updated, results[:first_output], strict=True):
                args[index].copy_(value)  # grad mode is off in here; these arguments need no gradient
            outputs, saved = results[first_output:returns], results[returns:]
            if keep:
                carrier = torch.empty(0)
                carrier.device_values = [saved[i] for i in computed_slots]
                ctx.save_for_backward(carrier, *(saved[i] for i in argument_slots))
            else:
                ctx.save_for_backward(*saved)
            ctx.kept = keep
            ctx.mark_non_differentiable(*(o for o, d in zip(outputs, differentiable, strict=True) if not d))
            return tuple(outputs)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
            tangents = [g for g, d in zip(grads, differentiable, strict=True) if d]
            stored = ctx.saved_tensors
            if not ctx.kept:
                return tuple(run_backward([*stored, *tangents]))
            saved: list[Any] = [None] * len(saved_kinds)
            for slot, value in zip(computed_slots, stored[0].device_values, strict=True):
                saved[slot] = value
            for slot, value in zip(argument_slots, stored[1:], strict=True):
                saved[slot] = value
            return tuple(run_backward([*saved, *tangents]))

    def run(*args: Any) -> tuple[Any, ...]:
        return CompiledGraph.apply(*args)

    return run


def _last_reader_call(backward: GraphExecutable) -> Callable[[list[Any]], list[Any]]:
    """The backward's call: the saved device buffers are handed over to the program (donated) unless autograd
    keeps the graph for another backward (``retain_graph``, ``create_graph``)."""

    def call(arguments: list[Any]) -> list[Any]:
        return backward.run(arguments, donate=not torch._C._autograd._get_current_graph_task_keep_graph())

    return call


def _saved_tensor_hooks_active() -> bool:
    """Whether ``torch.autograd.graph.saved_tensors_hooks`` (or a helper built on it) is in effect."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
