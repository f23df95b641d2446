"""Content-addressed cache keys: SHA-256 over a canonical, typed JSON encoding of what goes into a compile.

Keys are built only from what the compiler consumes (the program without source locations, the compile
target, the options, the versions of everything that turns one into the other), never from what it
produces, never from paths, pids, times or Python's ``hash``. Components are a flat mapping of named,
JSON-typed values so that two keys can be compared name by name (``tpucompile cache explain``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

KEY_SCHEMA = 1

ENVIRONMENT_COMPONENTS = (
    "platform",
    "platform_version",
    "device_kind",
    "device_count",
    "topology",
    "jaxlib",
    "host_blas",
    "xla_flags",
    "tpucompile",
    "tpucompile_sources",
    "torch",
)
"""Components that describe the machine and software rather than the program: an entry whose values differ
from this process's cannot be used here (a bundle import says which one). For a compile-only target
(``tpu:v5e:2x2``) platform, platform_version, device_kind, device_count and topology come from the target's
devices as libtpu describes them, so that they equal what a host of that slice computes for itself.
``host_blas`` fingerprints the BLAS kernels CPU programs call for matrix products (None where XLA's own dots
run); ``tpucompile_sources`` is a digest of every source file of the package, ``torch`` torch's version."""


def canonical_json(components: Mapping[str, Any]) -> bytes:
    """A byte encoding that is identical across processes and hosts for equal components."""
    return json.dumps(components, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def digest(data: bytes | str) -> str:
    """Hex SHA-256 of bytes or of a string's UTF-8 encoding."""
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def cache_key(components: Mapping[str, Any]) -> str:
    """The key of an entry: the hex SHA-256 of its canonical components."""
    return digest(canonical_json({"schema": KEY_SCHEMA, **components}))


def component_digests(components: Mapping[str, Any]) -> dict[str, str]:
    """One short digest per component, stored in entry headers and compared to find what differs."""
    return {name: digest(canonical_json({"v": value}))[:16] for name, value in components.items()}


def is_key(text: str) -> bool:
    """True for a well-formed key (64 lowercase hex digits); anything else never reaches a file path."""
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def executable_key_components(
    program: str,
    inputs: Sequence[tuple[str, Sequence[int]]],
    outputs: Sequence[tuple[str, Sequence[int]]],
    compile_options: bytes,
    environment: Mapping[str, Any],
    host_ops: Sequence[str] = (),
    rewrites: Sequence[str] = (),
) -> dict[str, Any]:
    """Components of a StableHLO → executable key.

    ``program`` is the module text without locations (or its SHA-256), ``inputs``/``outputs`` the
    signature as (dtype, shape) pairs, ``compile_options`` the serialised options with debug fields
    cleared, ``environment`` the values named in ``ENVIRONMENT_COMPONENTS``, ``host_ops`` the signatures of the
    ops compiled as calls of the host kernels (the rest is XLA's own code), ``rewrites`` the names of the
    rewrites applied to the module before XLA compiles it (``depthwise_taps`` on the CPU).
    """
    return {
        "kind": "executable",
        "program": program if is_key(program) else digest(program),
        "inputs": [[dtype, list(shape)] for dtype, shape in inputs],
        "outputs": [[dtype, list(shape)] for dtype, shape in outputs],
        "compile_options": digest(compile_options),
        "host_ops": sorted(host_ops),
        "rewrites": sorted(rewrites),
        **{name: environment[name] for name in ENVIRONMENT_COMPONENTS},
    }


def program_key_components(
    graph: str, environment: Mapping[str, Any], locations: str, donated: Sequence[str] = (),
    jax_lowerings: Sequence[Sequence[str]] = (), lowering: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Components of an ATen graph → StableHLO key: the graph's canonical digest, the environment, the
    digest of the source locations the program carries (so a cached program never shows stale lines), the
    kinds of marked arguments it donates, the JAX lowerings registered for its custom ops (name,
    platform, digest of the function's source: the graph names the op, not what lowers it), and the
    options that change how ops are lowered (``lowering``)."""
    return {
        "kind": "program",
        "graph": graph,
        "locations": locations,
        "donated": list(donated),
        "jax_lowerings": [list(entry) for entry in jax_lowerings],
        "lowering": dict(lowering or {}),
        **{name: environment[name] for name in ENVIRONMENT_COMPONENTS},
    }


def differing_components(first: Mapping[str, Any], second: Mapping[str, Any]) -> list[str]:
    """Names of the components whose values differ (or that only one side has), sorted."""
    names: Iterable[str] = set(first) | set(second)
    return sorted(n for n in names if canonical_json({"v": first.get(n)}) != canonical_json({"v": second.get(n)}))


def environment_mismatches(components: Mapping[str, Any], environment: Mapping[str, Any]) -> dict[str, tuple]:
    """``{name: (entry's value, this environment's value)}`` for each environment component that differs."""
    return {
        name: (components.get(name), environment.get(name))
        for name in ENVIRONMENT_COMPONENTS
        if canonical_json({"v": components.get(name)}) != canonical_json({"v": environment.get(name)})
    }

