"""Shardy attributes for sharded programs: the ``sdy.mesh``, ``sdy.sharding`` on arguments and results, and
``sdy.sharding_constraint`` for annotated intermediate values.

A graph is sharded when a sharding pass put ``shard_annotation`` nodes in it. An annotation of a placeholder
becomes that argument's sharding, an annotation that is returned becomes that result's sharding, any other
becomes a constraint. Every argument of a sharded program gets a closed sharding (replicated when nothing
was said), so the runtime knows the layout of every buffer it passes; a result without an annotation is laid
out as XLA's propagation finds best, and the runtime reads that layout from the compiled executable. XLA
propagates shardings to everything in between and inserts the collectives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch.fx
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import sdy

from tpucompile.errors import LoweringError
from tpucompile.lowering.registry import register_rule
from tpucompile.sharding.plan import Dims, decode_sharding, shard_annotation

MESH_NAME = "mesh"

MeshAxes = tuple[tuple[str, int], ...]


@dataclasses.dataclass(frozen=True)
class ProgramShardings:
    """The layout of a sharded program's arguments and results, read back from its module."""

    mesh: MeshAxes
    args: list[Dims]
    results: list[Dims | None]
    """None for a result the program leaves to XLA's propagation."""

    @property
    def partitions(self) -> int:
        count = 1
        for _, size in self.mesh:
            count *= size
        return count


def is_annotation(node: object) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is shard_annotation


def graph_mesh(nodes: Sequence[torch.fx.Node]) -> MeshAxes | None:
    """The mesh of a graph's sharding annotations, or None for an unsharded graph."""
    meshes = {decode_sharding(n.args[1])[0] for n in nodes if is_annotation(n)}
    if len(meshes) > 1:
        raise LoweringError(f"a graph's sharding annotations name several meshes: {sorted(meshes)}")
    return meshes.pop() if meshes else None


def annotation_dims(node: torch.fx.Node) -> Dims:
    return decode_sharding(node.args[1])[1]


def declare_mesh(module: ir.Module, mesh: MeshAxes) -> None:
    """Add ``sdy.mesh @mesh`` and the partition count to ``module`` (call before its functions are built)."""
    with ir.InsertionPoint(module.body):
        sdy.MeshOp(MESH_NAME, sdy.MeshAttr.get([sdy.MeshAxisAttr.get(name, size) for name, size in mesh]))
    partitions = 1
    for _, size in mesh:
        partitions *= size
    i32 = ir.IntegerType.get_signless(32)
    module.operation.attributes["mhlo.num_partitions"] = ir.IntegerAttr.get(i32, partitions)
    module.operation.attributes["mhlo.num_replicas"] = ir.IntegerAttr.get(i32, 1)


def sharding_attribute(dims: Dims, rank: int) -> ir.Attribute:
    """``#sdy.sharding<@mesh, [{"data"}, {}]>``: closed dimension shardings, the unnamed ones replicated."""
    dims = tuple(dims) + ((),) * (rank - len(dims))
    text = ", ".join("{" + ", ".join(f'"{axis}"' for axis in axes) + "}" for axes in dims)
    return ir.Attribute.parse(f"#sdy.sharding<@{MESH_NAME}, [{text}]>")


def set_shardings(main: ir.Operation, arg_dims: Sequence[Dims], arg_ranks: Sequence[int],
                  result_dims: Sequence[Dims | None], result_ranks: Sequence[int]) -> None:
    """Give the arguments and results of ``main`` their ``sdy.sharding`` (a result with None gets none: XLA
    lays it out as its propagation finds best)."""

    def attrs(dims: Sequence[Dims | None], ranks: Sequence[int]) -> ir.ArrayAttr:
        return ir.ArrayAttr.get([ir.DictAttr.get({} if d is None else {"sdy.sharding": sharding_attribute(d, r)})
                                 for d, r in zip(dims, ranks, strict=True)])

    main.attributes["arg_attrs"] = attrs(arg_dims, arg_ranks)
    main.attributes["res_attrs"] = attrs(result_dims, result_ranks)


@register_rule(shard_annotation)
def _sharding_constraint(ctx, value, sharding):
    """An annotated intermediate value: a constraint XLA's propagation must respect."""
    _, dims = decode_sharding(sharding)
    rank = len(ir.RankedTensorType(value.type).shape)
    return sdy.ShardingConstraintOp(value, sharding_attribute(dims, rank)).result


def module_mesh(module: ir.Operation) -> MeshAxes | None:
    """The axes of ``module``'s ``sdy.mesh`` (a ``builtin.module`` operation), or None when it declares none."""
    for op in module.regions[0].blocks[0].operations:
        if op.operation.name == "sdy.mesh" and ir.StringAttr(op.operation.attributes["sym_name"]).value == MESH_NAME:
            attr = sdy.MeshAttr(op.operation.attributes["mesh"])
            return tuple((sdy.MeshAxisAttr(a).name, sdy.MeshAxisAttr(a).size) for a in attr.axes)
    return None


def per_shard(operands: Sequence[ir.Value], operand_dims: Sequence[Dims], result_types: Sequence[ir.Type],
              result_dims: Sequence[Dims], mesh: MeshAxes,
              body: Callable[[list[ir.Value]], Sequence[ir.Value]]) -> list[ir.Value]:
    """``body`` on each device's shard, as ``sdy.manual_computation`` over every axis of ``mesh``: operand and
    result ``i`` are split along their dimensions as ``*_dims[i]`` says (axes named on no dimension:
    replicated), and ``body`` receives and returns the per-device blocks. For ops XLA's partitioner cannot
    split itself (a Pallas kernel's custom call, which it would otherwise run on whole operands on every
    device)."""
    sizes = dict(mesh)

    def local(type_: ir.Type, dims: Dims) -> ir.Type:
        ranked = ir.RankedTensorType(type_)
        shape = list(ranked.shape)
        for dim, axes in enumerate(dims):
            for axis in axes:
                shape[dim] //= sizes[axis]
        return ir.RankedTensorType.get(shape, ranked.element_type)

    def shardings(dims: Sequence[Dims], types: Sequence[ir.Type]) -> ir.Attribute:
        return sdy.TensorShardingPerValueAttr.get(
            [sharding_attribute(d, len(ir.RankedTensorType(t).shape)) for d, t in zip(dims, types, strict=True)])

    operand_types = [v.type for v in operands]
    op = sdy.ManualComputationOp(list(result_types), list(operands), shardings(operand_dims, operand_types),
                                 shardings(result_dims, result_types),
                                 sdy.ManualAxesAttr.get([ir.StringAttr.get(name) for name, _ in mesh]))
    block = op.body.blocks.append(*[local(t, d) for t, d in zip(operand_types, operand_dims, strict=True)])
    with ir.InsertionPoint(block):
        results = list(body(list(block.arguments)))
        expected = [local(t, d) for t, d in zip(result_types, result_dims, strict=True)]
        if [r.type for r in results] != expected:
            raise LoweringError(f"a per-shard body returned {[str(r.type) for r in results]}, expected "
                                f"{[str(t) for t in expected]}")
        sdy.ReturnOp(results)
    return list(op.results)


def program_shardings(module: ir.Module) -> ProgramShardings | None:
    """The mesh and the argument and result shardings of a lowered module; None when it is not sharded."""
    with module.context:
        mesh = module_mesh(module.operation)
        main = next((op.operation for op in module.body.operations if op.operation.name == "func.func"
                     and ir.StringAttr(op.operation.attributes["sym_name"]).value == "main"), None)
        if mesh is None or main is None:
            return None
        return ProgramShardings(mesh, _read(main, "arg_attrs"), _read(main, "res_attrs"))


def _read(main: ir.Operation, key: str) -> list[Dims | None]:
    if key not in main.attributes:
        return []
    found: list[Dims | None] = []
    for entry in ir.ArrayAttr(main.attributes[key]):
        entries = ir.DictAttr(entry)
        if "sdy.sharding" not in entries:
            found.append(None)
            continue
        sharding = sdy.TensorShardingAttr(entries["sdy.sharding"])
        dims = []
        for dim in sharding.dimension_shardings:
            dims.append(tuple(sdy.AxisRefAttr(a).name for a in sdy.DimensionShardingAttr(dim).axes))
        found.append(tuple(dims))
    return found
