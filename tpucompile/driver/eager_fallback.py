"""A graph tpucompile cannot compile whole: the ops it cannot lower run in eager PyTorch between compiled
regions, and ops whose result size depends on the data compile as regions of their own (their padded results
are cut to size on the host before the next region sees them)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from tpucompile import diagnostics
from tpucompile.driver.events import record_graph
from tpucompile.errors import TpuCompileError, TpuCompileWarning, UnsupportedOpError
from tpucompile.lowering.graph import has_data_dependent_size, unsupported_reason
from tpucompile.passes import isolate_node, partition_supported, saved_value_mismatch

RegionCompiler = Callable[[torch.fx.GraphModule, str], Callable[[list[Any]], list[Any]]]
"""Compiles one fully supported region (a submodule, its name) into a boxed callable."""

FALLBACK_HINT = " (pass options={'fallback': 'eager'} to run it in eager PyTorch instead)"


def compile_partitioned(
    gm: torch.fx.GraphModule, name: str, unsupported: list[torch.fx.Node], fallback: str,
    lifted_constants: list[torch.Tensor], compile_region: RegionCompiler,
) -> Callable[[list[Any]], Any]:
    """``gm`` split into compiled regions run from Python, the ``unsupported`` ops between them in eager
    PyTorch (refused with ``fallback="error"``, or where the eager op would read values its fused forward did
    not save)."""
    if unsupported and fallback == "error":
        raise UnsupportedOpError(unsupported_reason(unsupported[0]) + FALLBACK_HINT)
    for node in unsupported:
        mismatch = saved_value_mismatch(node)
        if mismatch is not None:
            raise UnsupportedOpError(f"{diagnostics.describe_node(node)} would run in eager PyTorch on values its "
                                     f"fused forward did not save for it: {mismatch}")
    _warn_fallback(unsupported)
    regions = partition_supported(
        gm, lambda node: unsupported_reason(node) is None and not has_data_dependent_size(node)
    )
    data_dependent = [n for n in gm.graph.nodes if has_data_dependent_size(n)]  # the partitioner made new nodes
    for index, node in enumerate(data_dependent):
        region = f"data_dependent_{index}"
        isolate_node(gm, node, region)
        regions.append(region)
    record_graph(name, "partitioned", gm)
    for region in regions:
        submodule = getattr(gm, region)
        compiled = compile_region(submodule, f"{name} {region}")
        setattr(gm, region, _CompiledRegion(compiled, _returns_tuple(submodule)))
    gm.recompile()
    return _EagerGraph(gm, lifted_constants)


_warned_ops: set[str] = set()


def _warn_fallback(nodes: list[torch.fx.Node]) -> None:
    """One warning per op kind and process, naming the op and where the user's code calls it."""
    for node in nodes:
        op = diagnostics.op_name(node.target)
        if op in _warned_ops:
            continue
        _warned_ops.add(op)
        warnings.warn(
            f"tpucompile runs {op} in eager PyTorch: {unsupported_reason(node)}", TpuCompileWarning, stacklevel=2
        )


class _CompiledRegion(torch.nn.Module):
    """A compiled region standing in for a partition submodule inside an eagerly run graph."""

    def __init__(self, run: Callable[[list[Any]], list[Any]], returns_tuple: bool) -> None:
        super().__init__()
        self.run = run
        self.returns_tuple = returns_tuple

    def forward(self, *args: Any) -> Any:
        outputs = self.run(list(args))
        return tuple(outputs) if self.returns_tuple else outputs[0]


def _returns_tuple(gm: torch.fx.GraphModule) -> bool:
    return isinstance(gm.graph.output_node().args[0], (tuple, list))


class _EagerGraph:
    """Runs a partitioned graph as Python: eager ATen ops between compiled regions. On meta inputs (a
    compile-only run) an eager op that has no meta kernel fails; the error then names that op and the user's
    source line, not the generated code of the graph."""

    def __init__(self, gm: torch.fx.GraphModule, constants: list[torch.Tensor]) -> None:
        self.gm = gm
        self.constants = constants
        self._boxed_call = True

    def __call__(self, args: list[Any]) -> Any:
        try:
            return self.gm(*args, *self.constants)
        except TpuCompileError:
            raise
        except Exception as error:
            if not any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
                raise
            node = _failing_node(self.gm, [*args, *self.constants])
            if node is None or node.op != "call_function":  # not one of the eager ops
                raise
            raise UnsupportedOpError(
                f"{diagnostics.describe_node(node)} runs in eager PyTorch here (tpucompile has no lowering for "
                f"it), and it cannot run on the meta tensors of a compile-only run: {str(error).splitlines()[0]}"
            ) from error


def _failing_node(gm: torch.fx.GraphModule, args: list[Any]) -> torch.fx.Node | None:
    """The node of ``gm`` whose op raises on ``args`` (meta tensors: running the graph again costs nothing)."""

    class _Tracking(torch.fx.Interpreter):
        failed: torch.fx.Node | None = None

        def run_node(self, node: torch.fx.Node) -> Any:
            try:
                return super().run_node(node)
            except Exception:
                self.failed = self.failed or node
                raise

    interpreter = _Tracking(gm)
    try:
        interpreter.run(*args)
    except Exception:
        return interpreter.failed
    return None
