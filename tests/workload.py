"""A small workload that the cache tests run in fresh processes; prints one JSON line about its compiles.

    python workload.py [--train] [--barrier DIR N] [--scale K]

``--barrier DIR N`` waits, after the imports, until N processes have reached the barrier, so that they
race on the same keys. The result is checked against eager PyTorch.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable

import torch

from tpucompile import driver


def _barrier(folder: str, count: int) -> None:
    path = pathlib.Path(folder)
    (path / f"ready-{os.getpid()}").touch()
    deadline = time.time() + 120
    while len(list(path.glob("ready-*"))) < count and time.time() < deadline:
        time.sleep(0.01)


def check_model(scale: int = 1, train: bool = False, options: dict | None = None,
                before_call: Callable[[], None] | None = None) -> bool:
    """Compile the workload's model with tpucompile (``options``), run it (a training step with ``train``)
    and say whether its results match eager PyTorch. ``before_call`` runs after ``torch.compile`` and
    before the first call, which is when the graphs compile."""
    torch.manual_seed(0)
    width = 16 * scale
    model = torch.nn.Sequential(torch.nn.Linear(width, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    x = torch.randn(4, width)
    compiled = torch.compile(model, backend="tpucompile", options=options)
    if before_call is not None:
        before_call()
    if train:
        loss = compiled(x).pow(2).sum()
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(x).pow(2).sum().backward()
        return all(torch.allclose(g, p.grad, atol=1e-5) for g, p in zip(grads, model.parameters(), strict=True))
    with torch.no_grad():
        return bool(torch.allclose(compiled(x), model(x), atol=1e-5))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--barrier", nargs=2)
    parser.add_argument("--scale", type=int, default=1)
    args = parser.parse_args()
    events = []
    driver.add_observer(events.append)
    barrier = (lambda: _barrier(args.barrier[0], int(args.barrier[1]))) if args.barrier else None
    ok = check_model(args.scale, args.train, before_call=barrier)
    print(json.dumps({
        "ok": bool(ok),
        "events": [
            {"name": e.name, "key": e.key, "tier": e.tier, "program_tier": e.program_tier,
             "components": e.key_components, "traced": e.graph is not None}
            for e in events
        ],
    }))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
