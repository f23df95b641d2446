"""ATen FX graph → one StableHLO module with a public ``func.func @main``.

Tensor placeholders become the function's arguments in graph order. Nodes whose value is a Python number
(SymInt arithmetic, ``sym_size``) are not lowered: they are evaluated to constants, since every module is
compiled for one concrete set of sizes. Graph outputs that are not results of the program (an input
returned as is, a size) are described by an output plan that the runtime follows.

An op whose result size depends on the data (``nonzero``, ``unique``) is lowered with results padded to a
static bound; its actual size becomes an extra result, and the output plan tells the runtime which dimension
to cut to it. Such an op must be the graph's only computation (the driver compiles it as a region of its
own), since anything computed from the padded values inside the program would see the padding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
import torch.fx
import torch.utils._pytree as pytree
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import func
from torch._subclasses.fake_tensor import unset_fake_temporarily

from tpucompile import diagnostics
from tpucompile.contracts.calling_convention import SEED_POSITION, OutputSlot
from tpucompile.contracts.donation_marks import DONATABLE, SAVED, UPDATED, kind_of
from tpucompile.contracts.loop_ops import is_loop
from tpucompile.contracts.size_expressions import runtime_size_assertion
from tpucompile.errors import LoweringError, TpuCompileError, UnsupportedOpError
from tpucompile.lowering import (
    builder,
    custom_ops,
    dynamic_sizes,
    grown_in_place,
    jax_bridge,
    loops,
    padding_safety,
    shardy_attributes,
    unmerged,
)
from tpucompile.lowering.context import mlir_context
from tpucompile.lowering.registry import (
    LoweringContext,
    is_random,
    lookup_rule,
    runs_on,
    size_bound,
    takes_complex,
)
from tpucompile.lowering.rng import SEED_SHAPE, RandomStream
from tpucompile.lowering.shapes import ShapeBindings
from tpucompile.lowering.types import SUPPORTED_DTYPES, TensorSpec, spec_of, spec_type


@dataclasses.dataclass
class LoweredProgram:
    """A lowered graph: the module and the calling convention the runtime needs to run it."""

    module: ir.Module
    input_specs: list[TensorSpec]
    """Specs of the module's arguments, in order."""
    input_positions: list[int]
    """For each module argument, the index of the graph placeholder it comes from, or ``SEED_POSITION`` for
    the seed of a program with random ops (the runtime draws a fresh one from torch on every call)."""
    result_specs: list[TensorSpec]
    output_plan: list[OutputSlot]
    cache_key: str | None = None
    """The key the program cache stores it under (set by the cache; None when the graph is uncacheable)."""
    input_aliases: list[int | None] = dataclasses.field(default_factory=list)
    """For each module argument, the result that may be written into its memory (the argument is donated:
    gone after the call), or None; empty when nothing is donated."""
    donated_kinds: frozenset[str] = frozenset()
    """The kinds of marked arguments (``donation_marks``) this program was lowered to donate."""
    runtime_sizes: tuple[str, ...] = ()
    """The size symbols whose actual values a bucketed program takes as ``i32`` arguments, in order (their
    input positions follow the graph's placeholders); empty for a program of static sizes."""
    repeated_flops: float = 0.0
    """The matrix products' flops of loop bodies' iterations after the first (``loops.product_flops``): XLA's
    cost analysis counts a loop's body once, and compile reports add these to its flops."""

    def text(self, debug_info: bool = True) -> str:
        """StableHLO text; with ``debug_info`` it carries the user's source locations."""
        return self.module.operation.get_asm(enable_debug_info=debug_info)

    def bytecode(self) -> bytes:
        """MLIR bytecode of the module, the cheapest form to hand to XLA."""
        import io

        stream = io.BytesIO()
        self.module.operation.write_bytecode(stream)
        return stream.getvalue()


def lower_graph(
    gm: torch.fx.GraphModule,
    bindings: ShapeBindings | None = None,
    verify: bool = True,
    donate: frozenset[str] = frozenset(),
    narrow_products: bool = False,
    narrow_elementwise: bool = True,
    stacked_outputs: bool = False,
) -> LoweredProgram:
    """Lower ``gm`` (a functional ATen graph) to StableHLO for the sizes in ``bindings``; arguments marked
    donatable with a kind in ``donate`` are donated to a result of their shape and dtype. ``narrow_products``:
    bf16/f16 matrix products write their rounded result directly (``rules/matmul.py``; the backend decides
    per program).
    ``narrow_elementwise``: bf16/f16 elementwise ops exact in their own dtype are computed in it
    (``registry.LoweringRule.exact_narrow``). ``stacked_outputs``: outputs that are every layer of one stacked
    loop result are returned as that result, once (``_stacked_parts``)."""
    bindings = bindings or ShapeBindings()
    # AOTAutograd calls the compiler with its FakeTensorMode active; constants that rules build from real
    # tensors (``builder.dense_constant``) must not be turned into fake ones.
    with unset_fake_temporarily(), mlir_context(), ir.Location.unknown():
        return _GraphLowering(gm, bindings, donate, narrow_products, narrow_elementwise, stacked_outputs).run(verify)


class _GraphLowering:
    def __init__(self, gm: torch.fx.GraphModule, bindings: ShapeBindings, donate: frozenset[str],
                 narrow_products: bool, narrow_elementwise: bool, stacked_outputs: bool = False) -> None:
        self.gm = gm
        self.stacked_outputs = stacked_outputs
        self.donate = donate
        self.narrow_products = narrow_products
        self.narrow_elementwise = narrow_elementwise
        self.bindings = ShapeBindings(  # a copy: data-dependent sizes get bound to their bounds below
            dict(bindings.values), bindings.runtime, bindings.unmerged_products, bindings.fixed_in_place,
            bindings.products_on_padding, bindings.input_extents)
        self.runtime = bindings.runtime
        self.sizes: dynamic_sizes.SizeValues | None = None
        """The values of runtime size expressions, in a bucketed program."""
        self.env: dict[torch.fx.Node, Any] = {}
        self.random: RandomStream | None = None
        self.repeated_flops = 0.0
        self.actual_sizes: dict[sympy.Symbol, Any] = {}
        """For each data-dependent size: the int64 scalar the program computes it into."""

    def run(self, verify: bool) -> LoweredProgram:
        graph = self.gm.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        tensor_inputs = [
            (i, n) for i, n in enumerate(placeholders) if isinstance(n.meta.get("val"), torch.Tensor)
        ]
        bucket_specs = [self._spec(n) for _, n in tensor_inputs]
        extents = self.bindings.input_extents
        input_specs = [TensorSpec(extents[i], spec.dtype) if i in extents else spec
                       for (i, _), spec in zip(tensor_inputs, bucket_specs, strict=True)]
        size_symbols = sorted(self.runtime, key=str)
        input_specs += [TensorSpec((), dynamic_sizes.SIZE_DTYPE) for _ in size_symbols]
        needs_seed = any(n.op == "call_function" and is_random(n.target) for n in graph.nodes)
        if needs_seed:
            input_specs.append(TensorSpec(SEED_SHAPE, torch.int64))
        output_node = graph.output_node()
        outputs = output_node.args[0]
        outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        parts, stack_dims = self._stacked_parts(outputs) if self.stacked_outputs and not size_symbols else ({}, {})
        result_nodes = [parts[o][0] if o in parts else o for o in outputs if self._is_result(o)]
        mesh = shardy_attributes.graph_mesh(list(graph.nodes))

        module = ir.Module.create()
        if mesh is not None:
            shardy_attributes.declare_mesh(module, mesh)
        with ir.InsertionPoint(module.body):
            main = func.FuncOp("main", ir.FunctionType.get([spec_type(s) for s in input_specs], []))
            main.attributes["sym_visibility"] = ir.StringAttr.get("public")
            block = main.add_entry_block()
        for (_, node), arg in zip(tensor_inputs, block.arguments, strict=False):
            self.env[node] = arg
        grown = grown_in_place.concatenations(tensor_inputs, result_nodes, self.bindings) if size_symbols else {}
        whole_arguments = {argument: self.env[argument] for argument in grown.values()}  # before the slice below
        if size_symbols:
            size_arguments = block.arguments[len(tensor_inputs):len(tensor_inputs) + len(size_symbols)]
            self.sizes = dynamic_sizes.SizeValues(dict(zip(size_symbols, size_arguments, strict=True)))
            with ir.InsertionPoint(block), ir.Location.unknown():
                for (index, node), spec in zip(tensor_inputs, bucket_specs, strict=True):
                    if index in extents:  # taken padded past the bucket: the bucket's leading part
                        self.env[node] = builder.slice_static(self.env[node], [0] * len(spec.shape), spec.shape,
                                                      [1] * len(spec.shape))
                    self.env[node] = self._marked(node.meta["val"], self.env[node])
        if needs_seed:
            with ir.InsertionPoint(block):
                self.random = RandomStream(block.arguments[len(tensor_inputs) + len(size_symbols)])
        for node in placeholders:
            if node not in self.env:
                self.env[node] = self.bindings.resolve(node.meta.get("val"))

        arg_shardings, aliases = self._argument_annotations(tensor_inputs, result_nodes)
        with ir.InsertionPoint(block):
            for node in graph.nodes:
                if node in aliases:
                    self.env[node] = self.env[node.args[0]]  # an argument or result attribute, set below
                elif node in grown:
                    with _location(node):
                        self.env[node] = grown_in_place.lower(node, grown[node], whole_arguments[grown[node]],
                                                              self.env, self.sizes, self.runtime)
                        self.env[node] = self._marked(node.meta.get("val"), self.env[node])
                elif node.op == "call_function":
                    self.env[node] = self._lower_call(node)
                    if self.sizes is not None and node.target is not operator.getitem:
                        with _location(node):
                            self.env[node] = self._marked(node.meta.get("val"), self.env[node])
                elif node.op == "get_attr":
                    self.env[node] = self._lower_constant(node)
            unique_results = list(dict.fromkeys(result_nodes))
            sizes = list(self.actual_sizes)
            returned = [self._result(n) for n in unique_results] + [self.actual_sizes[s] for s in sizes]
            func.ReturnOp(returned)
        result_specs = [spec_of(v) for v in returned]
        main.attributes["function_type"] = ir.TypeAttr.get(
            ir.FunctionType.get([spec_type(s) for s in input_specs], [spec_type(s) for s in result_specs])
        )
        arg_dims = [arg_shardings.get(node, ()) for _, node in tensor_inputs]
        result_dims = [shardy_attributes.annotation_dims(n) if shardy_attributes.is_annotation(n)
                       else stack_dims.get(n) for n in unique_results]
        if mesh is not None:
            shardy_attributes.set_shardings(main.operation, arg_dims + ([()] if needs_seed else []),
                                            [len(s.shape) for s in input_specs],
                                            result_dims + [()] * len(sizes), [len(s.shape) for s in result_specs])

        laid_out_alike = _layout_check(mesh, arg_dims, result_dims)
        aliases = self._input_aliases(tensor_inputs, outputs, unique_results, input_specs, result_specs,
                                      laid_out_alike)
        grown_into = {argument: cat for cat, argument in grown.items()}
        for k, (_, node) in enumerate(tensor_inputs):  # an argument grown in place takes its result
            if node in grown_into and aliases[k] is None and unique_results.index(grown_into[node]) not in aliases:
                aliases[k] = unique_results.index(grown_into[node])
        if any(a is not None for a in aliases):
            set_input_aliases(main.operation, aliases)

        input_index = {node: k for k, (_, node) in enumerate(tensor_inputs)}
        plan = []
        for out in outputs:
            if out in parts:
                stack, layer = parts[out]
                plan.append(OutputSlot("result", unique_results.index(stack), part=layer))
            elif out in unique_results:
                trim = self._trim(out, {s: len(unique_results) + k for k, s in enumerate(sizes)})
                plan.append(OutputSlot("result", unique_results.index(out), trim=trim))
            elif isinstance(out, torch.fx.Node) and out.op == "placeholder" and out in input_index:
                plan.append(OutputSlot("input", placeholders.index(out)))
            elif isinstance(out, torch.fx.Node):
                plan.append(OutputSlot("constant", value=self.env[out]))
            else:
                plan.append(OutputSlot("constant", value=out))
        if verify:
            _verify(module)
        return LoweredProgram(
            module=module,
            input_specs=input_specs,
            input_positions=[i for i, _ in tensor_inputs] + [len(placeholders) + k for k in range(len(size_symbols))]
            + ([SEED_POSITION] if needs_seed else []),
            result_specs=result_specs,
            output_plan=plan,
            input_aliases=aliases if any(a is not None for a in aliases) else [],
            donated_kinds=self.donate,
            runtime_sizes=tuple(str(s) for s in size_symbols),
            repeated_flops=self.repeated_flops,
        )

    def _stacked_parts(self, outputs: list[Any]) -> tuple[dict[Any, tuple[torch.fx.Node, int]], dict[Any, Any]]:
        """Outputs that are, together, every layer of one stacked result of a loop (a rolled backward's
        gradients of the layers' weights: ``squeeze(slice(stack, 0, i, i + 1), [0])``, each maybe under a
        sharding annotation), as {output: (stack, layer)}, and the sharding of each such stack (the layers'
        own, the layer axis whole). Returned once as the stack, the loop writes them where they are returned;
        returned per layer, XLA copies each out of the stack, which then counts among the program's
        temporaries, growing with depth. Each output is then a view of the stacked tensor (``PART``)."""
        found: dict[Any, tuple[torch.fx.Node, int, Any]] = {}
        for out in outputs:
            layer = _layer_of_stack(out)
            if layer is not None:
                found[out] = layer
        by_stack: dict[torch.fx.Node, list[Any]] = {}
        for out, (stack, _, _) in found.items():
            by_stack.setdefault(stack, []).append(out)
        parts: dict[Any, tuple[torch.fx.Node, int]] = {}
        stack_dims: dict[Any, Any] = {}
        for stack, outs in by_stack.items():
            layers = sorted(found[o][1] for o in outs)
            dims = {found[o][2] for o in outs}
            if layers != list(range(stack.meta["val"].shape[0])) or len(dims) != 1:
                continue  # not every layer, or laid out unalike: each stays a result of its own
            (layer_dims,) = dims
            stack_dims[stack] = None if layer_dims is None else ((), *layer_dims)
            parts.update({o: (stack, found[o][1]) for o in outs})
        return parts, stack_dims

    def _result(self, node: torch.fx.Node) -> Any:
        """The program result for ``node``: its value, of a fixed shape in a bucketed program."""
        value = unmerged.materialize(self.env[node])
        if self.sizes is None:
            return value
        dims = dynamic_sizes.symbolic_dims(node.meta["val"], self.runtime)
        return (dynamic_sizes.static_result(value, self.bindings.spec(node.meta["val"]), dims,
                                            self.bindings.fixed_in_place) if dims else value)

    @functools.cached_property
    def _on_padding(self) -> unmerged.OnPadding:
        """How products run over the whole bucket drop their operand's runtime sizes and mark their result."""
        def drop(value: ir.Value, dims: list[int]) -> ir.Value:
            return dynamic_sizes.fixed_shape(value, dims, self.bindings.fixed_in_place)

        def mark(value: ir.Value, dims: list[tuple[int, sympy.Expr]]) -> ir.Value:
            spec = TensorSpec(tuple(builder.shape_of(value)), builder.dtype_of(value))
            return dynamic_sizes.mark_dynamic(value, spec, dims, self.sizes)

        return unmerged.OnPadding(drop, mark, self.runtime)

    def _runtime_sized(self, node: torch.fx.Node) -> bool:
        """Whether a value ``node`` reads or makes has a runtime-sized dimension, or a size argument is
        runtime: a rolled loop is lowered for fixed shapes, though the program around it may have runtime
        sizes of its own (a symbolic stride of an argument the loop never reads)."""
        made = (v for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor))
        return (padding_safety.takes_runtime_sizes(node, self.runtime)
                or any(dynamic_sizes.symbolic_dims(v, self.runtime) for v in made))

    def _marked(self, val: Any, value: Any) -> Any:
        """``value`` with its runtime-sized dimensions marked (``dynamic_sizes``), element-wise for the results
        of an op with several."""
        if isinstance(value, unmerged.Unmerged):
            return value  # its value was marked as the leading sizes it keeps
        if isinstance(val, torch.Tensor):
            dims = dynamic_sizes.symbolic_dims(val, self.runtime)
            return dynamic_sizes.mark_dynamic(value, self.bindings.spec(val), dims, self.sizes) if dims else value
        if isinstance(val, (list, tuple)) and isinstance(value, (list, tuple)):
            return type(value)(self._marked(v, x) for v, x in zip(val, value, strict=True))
        return value

    def _input_aliases(
        self, tensor_inputs: list[tuple[int, torch.fx.Node]], outputs: list[Any], unique_results: list[Any],
        input_specs: list[TensorSpec], result_specs: list[TensorSpec],
        laid_out_alike: Callable[[int, int], bool] = lambda argument, result: True,
    ) -> list[int | None]:
        """The result each donated argument may be written into: an updated argument's new value, and for a
        saved value the first unclaimed result of its shape and dtype that the graph computes after the
        value's last read (as jax pairs ``donate_argnums`` by shape; a result born while the value is still
        read would make XLA copy the value first, trading memory traffic for nothing). A donated argument with
        no such result is left alone: nothing could reuse its memory. "Last read" is by the value's direct
        users: a loop that reads a saved stack through the stack's sharding annotation comes after that read,
        so its stacked gradient of the same shape is paired with the stack; XLA then copies the stack the loop
        still reads, and the peak is still lower than unpaired (``docs/benchmarks.md``, stacked layer outputs).
        In a sharded program an argument and a result pair only when they are split alike (``laid_out_alike``):
        each chip's blocks must be the same size, and a result left to XLA's propagation has no known layout."""
        aliases: list[int | None] = [None] * len(input_specs)
        if not self.donate:
            return aliases
        order = {node: index for index, node in enumerate(self.gm.graph.nodes)}
        claimed: set[int] = set()
        marks = [(k, node, kind_of(node.meta.get(DONATABLE)), node.meta.get(DONATABLE))
                 for k, (_, node) in enumerate(tensor_inputs)]
        for k, _, kind, mark in marks:
            if kind == UPDATED and kind in self.donate and mark < len(outputs) and outputs[mark] in unique_results:
                result = unique_results.index(outputs[mark])
                if result not in claimed and result_specs[result] == input_specs[k] and laid_out_alike(k, result):
                    aliases[k] = result
                    claimed.add(result)
        for k, node, kind, _ in marks:
            if kind != SAVED or kind not in self.donate:
                continue
            last_read = max((order[user] for user in node.users if user.op != "output"), default=-1)
            result = next((r for r, result_node in enumerate(unique_results)
                           if r not in claimed and result_specs[r] == input_specs[k]
                           and order[result_node] > last_read and laid_out_alike(k, r)), None)
            if result is not None:
                aliases[k] = result
                claimed.add(result)
        return aliases

    def _argument_annotations(
        self, tensor_inputs: list[tuple[int, torch.fx.Node]], result_nodes: list[Any]
    ) -> tuple[dict[torch.fx.Node, Any], set[torch.fx.Node]]:
        """Sharding annotations that become attributes instead of ops: the dims of each annotated
        placeholder, and the annotations that stand for their operand (of a placeholder, or returned)."""
        arg_shardings: dict[torch.fx.Node, Any] = {}
        aliases: set[torch.fx.Node] = set()
        inputs = {node for _, node in tensor_inputs}
        for node in self.gm.graph.nodes:
            if not shardy_attributes.is_annotation(node):
                continue
            if node.args[0] in inputs and node.args[0] not in arg_shardings:
                arg_shardings[node.args[0]] = shardy_attributes.annotation_dims(node)
                aliases.add(node)
            elif node in result_nodes:
                aliases.add(node)
        return arg_shardings, aliases

    def _trim(self, node: torch.fx.Node, size_results: dict[sympy.Symbol, int]) -> tuple[tuple[int, int], ...]:
        trim = []
        for dim, size in enumerate(node.meta["val"].shape):
            if isinstance(size, torch.SymInt) and size.node.expr in size_results:
                trim.append((dim, size_results[size.node.expr]))
        return tuple(trim)

    def _is_result(self, out: Any) -> bool:
        return (
            isinstance(out, torch.fx.Node)
            and out.op != "placeholder"
            and isinstance(out.meta.get("val"), torch.Tensor)
        )

    def _spec(self, node: torch.fx.Node) -> TensorSpec:
        val = node.meta["val"]
        if val.dtype not in SUPPORTED_DTYPES:
            raise UnsupportedOpError(f"dtype {val.dtype} is not supported: {diagnostics.describe_node(node)}")
        return self.bindings.spec(val)

    def _lower_constant(self, node: torch.fx.Node, owner: torch.fx.GraphModule | None = None) -> Any:
        value = getattr(owner if owner is not None else self.gm, str(node.target))
        if not isinstance(value, torch.Tensor):
            return value
        if value.dtype not in SUPPORTED_DTYPES:
            raise UnsupportedOpError(f"constant {node.target!r} has unsupported dtype {value.dtype}")
        with _location(node):
            return builder.dense_constant(value)

    def _lower_call(self, node: torch.fx.Node) -> Any:
        val = node.meta.get("val")
        if node.target is operator.getitem:
            return self.env[node.args[0]][node.args[1]]
        if self.sizes is not None and runtime_size_assertion(node, self.runtime) is not None:
            return None  # the bucketed graph checks it on every call's sizes (``runtime/buckets``)
        if val is not None and not isinstance(val, (torch.Tensor, list, tuple)):
            return self.bindings.resolve(val)  # SymInt arithmetic: a constant of this specialisation
        if is_loop(node):
            if self.sizes is not None and self._runtime_sized(node):
                raise UnsupportedOpError(f"a rolled loop over runtime-sized values: "
                                         f"{diagnostics.describe_node(node)}")
            self.repeated_flops += loops.repeated_flops(node)
            with _location(node):
                return loops.lower_scan(node, self.env, self._lower_body)
        reason = unsupported_reason(node)
        if reason is not None:
            raise UnsupportedOpError(reason)
        rule = _rule(node.target)
        padded = rule.bound is not None
        symbol = self._bind_data_dependent_size(node, rule.bound) if padded else None
        if self.sizes is not None and self.bindings.unmerged_products:
            kept = unmerged.lower(node, self.env, self.runtime, _tensor_dtype(val),
                                  self._on_padding if self.bindings.products_on_padding else None)
            if kept is not None:
                with _location(node):
                    return kept
        if self.sizes is not None and node.target in padding_safety.RESHAPES:
            kind, detail = padding_safety.reshape_plan(node, self.runtime)
            if kind == "split":
                with _location(node):
                    return self._split_reshape(node, *detail)
            if kind == "outer-split":
                with _location(node):
                    fixed = dynamic_sizes.fixed_shape(self._materialize(node.args[0]), [detail],
                                                      self.bindings.fixed_in_place)
                    return builder.reshape(fixed, self.bindings.spec(node.meta["val"]).shape)
        args = [self._materialize(a) for a in node.args]
        kwargs = {k: self._materialize(v) for k, v in node.kwargs.items()}
        ctx = LoweringContext(
            node=node,
            avals_out=self._output_specs(val),
            operand_metas=[_meta(a) for a in node.args],
            random=self.random,
            extent=self._extent,
            fixed_in_place=self.bindings.fixed_in_place,
            runtime_scalars=self._runtime_scalars(node),
            narrow_products=self.narrow_products,
            narrow_elementwise=self.narrow_elementwise,
        )
        with _location(node):
            try:
                result = rule(ctx, args, kwargs)
            except TpuCompileError as error:
                if diagnostics.op_name(node.target) in str(error):
                    raise
                raise type(error)(f"{error}\n  while lowering {diagnostics.describe_node(node)}") from error
            except Exception as error:  # a bug in a rule: name the node, keep the cause chained
                raise LoweringError(
                    f"lowering {diagnostics.describe_node(node)} failed: {type(error).__name__}: {error}"
                ) from error
        if self.sizes is not None and node.target in padding_safety.WINDOWS:
            result = self._fixed_windows(node, result)
        if padded:
            *result, size = result
            if symbol is not None:
                self.actual_sizes[symbol] = size
            if not isinstance(val, (list, tuple)):
                (result,) = result
        self._check_result(node, ctx, result)
        return result

    def _lower_body(self, body: torch.fx.GraphModule, arguments: Sequence[Any]) -> list[Any]:
        """The values of a loop body's outputs, its ops lowered at the current insertion point on
        ``arguments`` (its placeholders' values, in order)."""
        outer = self.env
        self.env = {}
        try:
            placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
            self.env.update(zip(placeholders, arguments, strict=True))
            for node in body.graph.nodes:
                if node.op == "call_function":
                    self.env[node] = self._lower_call(node)
                elif node.op == "get_attr":
                    self.env[node] = self._lower_constant(node, body)
            outputs = body.graph.output_node().args[0]
            return [unmerged.materialize(self.env[o]) for o in outputs]
        finally:
            self.env = outer

    def _fixed_windows(self, node: torch.fx.Node, result: Any) -> Any:
        """A slice (or split piece) of fixed extent taken from a runtime-sized dimension, made a value of fixed
        shape: XLA takes such a slice as runtime-sized (its actual extent, the smaller of the window and what
        is left), which is harmless inside the program but cannot leave it."""
        operand = node.args[0].meta["val"]
        position = padding_safety.WINDOWS[node.target]
        dim = (node.args[position] if len(node.args) > position else node.kwargs.get("dim", 0)) % max(operand.dim(), 1)
        if not any(d == dim for d, _ in dynamic_sizes.symbolic_dims(operand, self.runtime)):
            return result
        vals = node.meta["val"] if isinstance(node.meta["val"], (list, tuple)) else [node.meta["val"]]
        values = result if isinstance(result, (list, tuple)) else [result]
        fixed = [dynamic_sizes.fixed_shape(value, [dim], self.bindings.fixed_in_place)
                 if not any(d == dim for d, _ in dynamic_sizes.symbolic_dims(val, self.runtime))
                 and val.shape[dim] > 1 else value
                 for val, value in zip(vals, values, strict=True)]
        return type(result)(fixed) if isinstance(result, (list, tuple)) else fixed[0]

    def _extent(self, meta: Any, dim: int) -> ir.Value | None:
        """The actual size of ``meta``'s dimension ``dim`` in a bucketed program, when it is runtime-sized."""
        if self.sizes is None or not isinstance(meta, torch.Tensor):
            return None
        dim %= max(meta.dim(), 1)
        for runtime_dim, expr in dynamic_sizes.symbolic_dims(meta, self.runtime):
            if runtime_dim == dim:
                return self.sizes.of(expr)
        return None

    def _runtime_scalars(self, node: torch.fx.Node) -> dict[int, ir.Value]:
        """The values, computed when the program runs, of ``node``'s positional arguments that are numbers
        depending on runtime sizes (``LoweringContext.runtime_scalars``); none outside a bucketed program."""
        if self.sizes is None:
            return {}
        found = {}
        for position, arg in enumerate(node.args):
            val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg
            if isinstance(val, (torch.SymInt, torch.SymFloat)):
                expr = sympy.sympify(val.node.expr)
                if expr.free_symbols & self.runtime:
                    with contextlib.suppress(dynamic_sizes.UnboundedSize):  # a size only: the bucket's value
                        found[position] = self.sizes.of(expr)
        return found

    def _split_reshape(self, node: torch.fx.Node, dim: int, out_dims: list[int]) -> Any:
        """A view that splits runtime-sized dimension ``dim`` into ``out_dims`` with the runtime-sized one
        inside, as ``dynamic_sizes.split_dimension`` gathers it, then reshaped to the view's shape."""
        source, result = node.args[0].meta["val"], node.meta["val"]
        group = []
        for out_dim in range(out_dims[0], out_dims[-1] + 1):
            size = result.shape[out_dim]
            expr = sympy.sympify(size.node.expr) if isinstance(size, torch.SymInt) else sympy.Integer(int(size))
            group.append((self.bindings.resolve(size), expr))
        split = dynamic_sizes.split_dimension(self._materialize(node.args[0]), self.bindings.spec(source), dim, group,
                                              self.sizes)
        return builder.reshape(split, self.bindings.spec(result).shape)

    def _bind_data_dependent_size(self, node: torch.fx.Node, bound: Any) -> sympy.Symbol | None:
        """Bind the op's data-dependent size to its static bound, so its results get padded types.

        None when the traced sizes are all known already (an empty input: the size is 0 whatever the data).
        """
        symbols = self._unbound_symbols(node.meta.get("val"))
        if not symbols:
            return None
        if len(symbols) != 1:
            raise LoweringError(f"expected one data-dependent size in {diagnostics.describe_node(node)}")
        users = [u for user in node.users for u in ([user] if user.op == "output" else user.users)]
        if any(u.op != "output" for u in users):
            raise LoweringError(
                f"{diagnostics.describe_node(node)} has a data-dependent result size and must be compiled "
                "as a graph of its own (the driver splits it out)"
            )
        operand_specs = [self._operand_spec(a) for a in node.args]
        kwarg_specs = {k: self._operand_spec(v) for k, v in node.kwargs.items()}
        self.bindings.values[symbols[0]] = sympy.Integer(bound(*operand_specs, **kwarg_specs))
        return symbols[0]

    def _operand_spec(self, arg: Any) -> Any:
        meta = _meta(arg)
        return self.bindings.spec(meta) if isinstance(meta, torch.Tensor) else self.bindings.resolve(meta)

    def _unbound_symbols(self, val: Any) -> list[sympy.Symbol]:
        found: dict[sympy.Symbol, None] = {}
        for item in val if isinstance(val, (list, tuple)) else [val]:
            if isinstance(item, torch.Tensor):
                for size in item.shape:
                    if isinstance(size, torch.SymInt):
                        for symbol in sympy.sympify(size.node.expr).free_symbols:
                            if symbol not in self.bindings.values:
                                found[symbol] = None
        return list(found)

    def _output_specs(self, val: Any) -> list[TensorSpec | None]:
        if isinstance(val, (list, tuple)):
            return [self.bindings.spec(v) if isinstance(v, torch.Tensor) else None for v in val]
        return [self.bindings.spec(val)] if isinstance(val, torch.Tensor) else [None]

    def _check_result(self, node: torch.fx.Node, ctx: LoweringContext, result: Any) -> None:
        """A rule must produce exactly the types the traced graph promised; catch rule bugs here."""
        results = list(result) if isinstance(result, (list, tuple)) else [result]
        if len(results) != len(ctx.avals_out):
            raise LoweringError(
                f"rule for {diagnostics.describe_node(node)} returned {len(results)} values, "
                f"expected {len(ctx.avals_out)}"
            )
        for got, expected in zip(results, ctx.avals_out, strict=True):
            if expected is None or got is None:
                continue
            actual = spec_of(got)
            if actual != expected:
                raise LoweringError(
                    f"rule for {diagnostics.describe_node(node)} produced {actual}, expected {expected}"
                )

    def _materialize(self, arg: Any) -> Any:
        if isinstance(arg, torch.fx.Node):
            return unmerged.materialize(self.env[arg])
        if isinstance(arg, (list, tuple)):
            return type(arg)(self._materialize(a) for a in arg)
        return self.bindings.resolve(arg)


def unsupported_reason(node: torch.fx.Node) -> str | None:
    """Why ``node`` cannot be lowered (an unsupported dtype, or no rule for its op), or None if it can."""
    if node.op != "call_function" or node.target is operator.getitem:
        return None
    if is_loop(node):
        return loops.unsupported_in_body(node, unsupported_reason)
    val = node.meta.get("val")
    if val is not None and not isinstance(val, (torch.Tensor, list, tuple)):
        return None  # size arithmetic, evaluated while lowering
    dtypes = [t.dtype for t in _tensor_metas(node)]
    for dtype in dtypes:
        if dtype not in SUPPORTED_DTYPES:
            return f"dtype {dtype} is not supported: {diagnostics.describe_node(node)}"
    if _rule(node.target) is None:
        return f"no lowering for {diagnostics.describe_node(node)}"
    platform = jax_bridge.current_platform()
    if not runs_on(node.target, platform):
        return f"XLA has no lowering of this op for {platform}: {diagnostics.describe_node(node)}"
    if not takes_complex(node.target) and any(dtype.is_complex for dtype in dtypes):
        return (f"complex values are not lowered for this op (its lowering is a real-only algorithm): "
                f"{diagnostics.describe_node(node)}")
    return None


def _tensor_metas(node: torch.fx.Node) -> list[torch.Tensor]:
    """The traced tensors of ``node``'s arguments and results, in argument order, then the results."""
    metas = []
    for value in [*node.args, *node.kwargs.values(), node]:
        found = _meta(value)
        metas += found if isinstance(found, list) else [found]
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        metas += list(val)
    return [m for m in metas if isinstance(m, torch.Tensor)]


def _rule(op: object) -> Any:
    """tpucompile's rule for ``op``, else the rule of the JAX lowerings registered for custom ops when one is
    registered for the platform lowered for (``jax_bridge.target_platform``; the driver sets it)."""
    rule = lookup_rule(op)
    if rule is None and custom_ops.find(op, jax_bridge.current_platform()) is not None:
        return custom_ops.REGISTERED_RULE
    return rule


def has_data_dependent_size(node: torch.fx.Node) -> bool:
    """Whether ``node`` is an op whose result size depends on the data (lowered padded, see the module doc)."""
    return node.op == "call_function" and size_bound(node.target) is not None


def _tensor_dtype(val: Any) -> torch.dtype | None:
    return val.dtype if isinstance(val, torch.Tensor) else None


def _meta(arg: Any) -> Any:
    if isinstance(arg, torch.fx.Node):
        return arg.meta.get("val")
    if isinstance(arg, (list, tuple)):
        return [_meta(a) for a in arg]
    return arg


def _location(node: torch.fx.Node) -> ir.Location:
    name = diagnostics.op_name(node.target)
    where = diagnostics.source_location(node)
    if where is None:
        return ir.Location.name(name)
    return ir.Location.name(name, childLoc=ir.Location.file(where.file, where.line, 0))


def set_input_aliases(main: ir.Operation, aliases: list[int | None]) -> None:
    """Record on ``main``'s arguments which result may take each one's memory (``tf.aliasing_output``, the
    attribute XLA reads as input/output aliasing), keeping the attributes they already have."""
    existing = ir.ArrayAttr(main.attributes["arg_attrs"]) if "arg_attrs" in main.attributes else None
    entries = []
    for k, alias in enumerate(aliases):
        attrs = {} if existing is None else {a.name: a.attr for a in ir.DictAttr(existing[k])}
        if alias is not None:
            attrs["tf.aliasing_output"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), alias)
        entries.append(ir.DictAttr.get(attrs))
    main.attributes["arg_attrs"] = ir.ArrayAttr.get(entries)


def _verify(module: ir.Module) -> None:
    try:
        module.operation.verify()
    except ir.MLIRError as error:
        raise LoweringError(f"tpucompile built an invalid StableHLO module: {error}") from error



def _layout_check(mesh: Any, argument_dims: list[Any], result_dims: list[Any]) -> Callable[[int, int], bool]:
    """Whether argument ``k`` and result ``r`` of a program are split alike over its mesh (always, unsharded);
    a result without an annotation is laid out by XLA's propagation, unknown here, so it matches nothing."""
    if mesh is None:
        return lambda argument, result: True

    def padded(dims: Any, rank: int) -> tuple:
        return tuple(tuple(d) for d in dims) + ((),) * (rank - len(dims))

    def alike(argument: int, result: int) -> bool:
        wanted = result_dims[result]
        if wanted is None:
            return False
        rank = max(len(argument_dims[argument]), len(wanted))
        return padded(argument_dims[argument], rank) == padded(wanted, rank)

    return alike


def _layer_of_stack(out: Any) -> tuple[torch.fx.Node, int, Any] | None:
    """(stack, layer, sharding dims or None) when graph output ``out`` is layer ``layer`` of a loop's stacked
    result ``stack``: ``squeeze(slice(stack, 0, layer, layer + 1), [0])``, maybe under a sharding annotation."""
    dims = None
    node = out
    if shardy_attributes.is_annotation(node):
        dims = shardy_attributes.annotation_dims(node)
        node = node.args[0]
    if not (isinstance(node, torch.fx.Node) and node.target is torch.ops.aten.squeeze.dims
            and list(node.args[1]) == [0] and len(node.users) == 1):
        return None
    piece = node.args[0]
    if not (isinstance(piece, torch.fx.Node) and piece.target is torch.ops.aten.slice.Tensor):
        return None
    stack, dim, start, end, step = (*piece.args, *(None,) * (5 - len(piece.args)))[:5]
    if dim not in (0, None) or step not in (1, None) or not isinstance(start, int) or end != start + 1:
        return None
    if not (isinstance(stack, torch.fx.Node) and stack.target is operator.getitem and is_loop(stack.args[0])):
        return None
    return stack, start, dims
