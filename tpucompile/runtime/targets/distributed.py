"""Several processes (hosts) sharing one mesh, through ``jax.distributed``.

Every process runs the same script and compiles the same program (the shared compile cache turns all but one
of those compiles into hits); each places and reads the shards of its own devices, and XLA's collectives
(gloo on CPU) cross the processes. ``jax.distributed`` must start before jax's backend does, so it is
initialised by the first sharded compile, ahead of everything else.
"""

from __future__ import annotations

import os

import jax

from tpucompile.errors import ShardingError
from tpucompile.runtime.targets.local import get_target


def initialize(coordinator: str | None, num_processes: int, process_id: int | None) -> None:
    """Join the ``num_processes`` processes of this run (nothing to do for one, or when already joined).

    ``coordinator`` defaults to ``MASTER_ADDR`` and ``MASTER_PORT`` + 1 (torch.distributed's own store takes
    ``MASTER_PORT``) and ``process_id`` to ``RANK`` (the variables ``torchrun`` sets); when those are unset
    too, jax's own cluster detection decides.
    """
    if num_processes <= 1:
        return
    if jax.distributed.is_initialized():
        if jax.process_count() != num_processes:
            raise ShardingError(f"jax.distributed runs {jax.process_count()} processes, options say "
                                f"num_processes={num_processes}")
        return
    if coordinator is None and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT", "").isdigit():
        coordinator = f"{os.environ['MASTER_ADDR']}:{int(os.environ['MASTER_PORT']) + 1}"
    if process_id is None and os.environ.get("RANK", "").isdigit():
        process_id = int(os.environ["RANK"])
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id)
    except (RuntimeError, ValueError) as error:
        raise ShardingError(
            f"cannot join {num_processes} processes through jax.distributed (coordinator {coordinator}, "
            f"process {process_id}): {error}. It must start before anything else uses jax in this process."
        ) from error


def process_devices(platform: str | None) -> list[int]:
    """The id of the first device of each process, by process index (torch rank r runs there)."""
    client = get_target(platform).client
    first: dict[int, int] = {}
    for device in sorted(client.devices(), key=lambda d: d.id):
        first.setdefault(device.process_index, device.id)
    return [first[index] for index in sorted(first)]


def process_count() -> int:
    """How many processes share the devices (1 without ``jax.distributed``, found without starting jax's
    backends)."""
    return jax.process_count() if jax.distributed.is_initialized() else 1
