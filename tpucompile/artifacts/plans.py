"""The plan layer: what AOTAutograd made of a Dynamo graph (``tpucompile.plan_replay``), stored as JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tpucompile.artifacts import stores
from tpucompile.cache import Entry, cache_key, canonical_json


def load_plan(components: Mapping[str, Any], tiers: stores.ArtifactTiers) -> tuple[dict[str, Any], str] | None:
    """(plan, tier) stored under ``components``' key (see ``tpucompile.plan_replay``), or None."""
    key = cache_key(components)
    plan = tiers.get(stores.plans, key)
    if plan is not None:
        return plan, "memory"
    cache = tiers.persistent
    found = cache.get(key) if cache is not None else None
    if found is None:
        return None
    entry, tier = found
    try:
        if entry.kind != "plan":
            raise ValueError(f"entry of kind {entry.kind!r}")
        plan = json.loads(entry.payload)
        if not isinstance(plan, dict):
            raise ValueError("payload is not a JSON object")
    except Exception as error:
        cache.quarantine(key, f"plan entry does not load: {type(error).__name__}: {error}")
        return None
    tiers.put(stores.plans, key, plan)
    cache.record_hit(key, entry.compile_seconds, "plan")
    return plan, tier


def store_plan(components: Mapping[str, Any], plan: dict[str, Any], seconds: float,
               tiers: stores.ArtifactTiers) -> None:
    """Keep ``plan`` in memory and, when the cache is writable, as a JSON entry (never pickle)."""
    tiers.put(stores.plans, cache_key(components), plan)
    cache = tiers.persistent
    if cache is not None:
        cache.record_miss("plan")
        if cache.writable:
            cache.put(Entry.create(dict(components), canonical_json(plan), {}, seconds))
