"""The torch-aware side of the compile cache: what goes into keys, and how values become bytes and back.

Three layers, each memory → local directory → remote (``tpucompile.cache``):

* **program** (``programs``): ATen graph → lowered StableHLO, keyed by the graph's canonical encoding
  (``fingerprint``), the source locations the program will carry, and the environment. A hit skips lowering.
* **executable** (``executables``): StableHLO → loaded XLA executable, keyed by the program text without
  locations, its signature, the compile options, the host-kernel choices and the environment; portable across
  hosts and checkouts (nothing in it is a path, a pid, a time or a hash seed). ``other_targets`` stores
  executables for compile-only targets under the key a host of that target computes.
* **plan** (``plans``): what AOTAutograd made of a Dynamo graph (``tpucompile.plan_replay``), as JSON.

Every key carries ``environment``: the machine and software, including one digest of the package's own
source (``package_digest``), so a change to any code that decides what is compiled changes every key.
"""

from tpucompile.artifacts.environment import environment, package_digest
from tpucompile.artifacts.executables import (
    LoadedExecutable,
    executable_components,
    host_ops_chosen,
    load_executable,
    remember_host_ops,
)
from tpucompile.artifacts.fingerprint import Uncacheable, encode_argument, encode_constant, encode_graph
from tpucompile.artifacts.other_targets import TargetOutcome, compile_for_target
from tpucompile.artifacts.plans import load_plan, store_plan
from tpucompile.artifacts.programs import lowered_program, program_from_key
from tpucompile.artifacts.stores import ArtifactTiers, artifact_tiers, clear_memory, executable_cache, persistent_cache
from tpucompile.artifacts.usage import record_at_exit

record_at_exit()

__all__ = [
    "ArtifactTiers",
    "LoadedExecutable",
    "TargetOutcome",
    "Uncacheable",
    "artifact_tiers",
    "clear_memory",
    "compile_for_target",
    "encode_argument",
    "encode_constant",
    "encode_graph",
    "environment",
    "executable_cache",
    "executable_components",
    "host_ops_chosen",
    "load_executable",
    "load_plan",
    "lowered_program",
    "package_digest",
    "persistent_cache",
    "program_from_key",
    "remember_host_ops",
    "store_plan",
]
