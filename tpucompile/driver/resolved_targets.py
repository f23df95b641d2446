"""The devices one compile is for and where its artifacts are kept, worked out once from its options: the
backend resolves them as a graph arrives and hands the record down, so no later stage reads target names or
cache settings again."""

from __future__ import annotations

import dataclasses

from tpucompile.artifacts import ArtifactTiers, artifact_tiers
from tpucompile.config import Options, compact_embedding_grad_for
from tpucompile.contracts import target_names
from tpucompile.frontend.decompositions import decomposition_table
from tpucompile.frontend.traced_implementations import custom_op_overloads
from tpucompile.lowering import custom_ops
from tpucompile.lowering.registry import lookup_rule
from tpucompile.runtime import Target, get_mesh_target, get_target
from tpucompile.runtime.targets.compile_only import compile_targets, spanning


@dataclasses.dataclass(frozen=True)
class CompileTargets:
    """Where the graphs of one compile are lowered, compiled and run, and where their artifacts are kept."""

    lowered_for: Target
    """What graphs are lowered for: this process's device or mesh; in a compile-only run, the first compile-only
    target, widened to the mesh (its mesh may be larger than this machine)."""
    compile_only: tuple[Target, ...]
    """The targets every graph is also compiled for and stored, never run here, each as wide as ``lowered_for``."""
    platforms: frozenset[str]
    """The platforms graphs are lowered for: the compile-only targets' and, unless the compile is only for
    them, this process's own (a custom op's JAX lowering must cover every one to keep the op whole)."""
    attention_kernel: bool
    """Whether attention goes to its kernel op (``options.attention``; in "auto", where a TPU compiles it)."""
    tiers: ArtifactTiers
    """The memory tiers and persistent cache the compile's programs, executables and plans are found in and kept
    in."""


def resolve_targets(options: Options) -> CompileTargets:
    """The targets of a compile with ``options``."""
    size = 1 if options.mesh is None else options.mesh.size
    others = compile_targets(options.targets, options.platform) if options.targets else ()
    if options.compile_only and others:
        lowered_for = spanning(others[0], size)
    elif options.mesh is None:
        lowered_for = get_target(options.platform)
    else:
        lowered_for = get_mesh_target(options.platform, size, options.mesh.devices)
    platforms = {target_names.parse(name).platform for name in options.targets}
    if not options.compile_only:
        platforms.add(get_target(options.platform).platform)
    return CompileTargets(lowered_for, tuple(spanning(t, len(lowered_for.devices)) for t in others),
                          frozenset(platforms), _attention_kernel(options), artifact_tiers(options))


def _attention_kernel(options: Options) -> bool:
    if options.attention != "auto":
        return options.attention in ("kernel", "interpret")
    if options.platform == "tpu" or any(target.startswith("tpu") for target in options.targets):
        return True
    if options.platform is None:  # through the runtime, which sets jax up before its backend starts
        return get_target(None).platform == "tpu"
    return False


def custom_ops_lowered_whole(targets: CompileTargets) -> frozenset[str]:
    """The custom ops (``torch.library.custom_op``) that reach the lowering whole in a compile for ``targets``:
    those with a lowering rule of tpucompile's, and those whose registered JAX lowerings cover every platform
    the compile lowers for. AOTAutograd traces the others through their implementations."""
    return frozenset(name for name, op in custom_op_overloads().items()
                     if lookup_rule(op) is not None or custom_ops.lowers(op, targets.platforms))


def decompositions_for(targets: CompileTargets, options: Options) -> dict:
    """The decomposition table AOTAutograd traces a compile for ``targets`` under ``options`` with: the one the
    backend hands it and the one a cached plan's key digests, so the two never differ."""
    return decomposition_table(custom_ops_lowered_whole(targets), targets.attention_kernel,
                               compact_embedding_grad_for(options.compact_embedding_grad, options.mesh))
