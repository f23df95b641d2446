"""Threads of one process: compiles of different models run side by side with calls of one shared compiled
module, and each model is still compiled once, with every result right."""

from __future__ import annotations

import collections
import threading

import torch

from tests.cached_runs import fault_repetitions, fresh_start, report


def _model(width: int, hidden: int, outputs: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, outputs))


def test_threads_compile_different_models_while_others_share_one(cache_dir, monkeypatch):
    """16 threads released together: 8 each compile and run a model of their own (widths differ, so their
    programs do), 8 call one compiled module that none of them has run yet. Every result equals eager
    PyTorch and each of the 9 models is compiled once: one compile event per key that no cache tier served,
    whatever the interleaving. One round; 5 with $TPUCOMPILE_FULL_FAULTS=1 (a fresh start and an empty cache each).

    The 9 models share one ``forward``, whose Dynamo cache holds 8 entries by default and would make sizes
    dynamic on a second shape: both are set aside, so that each model is one graph of its own."""
    rounds = fault_repetitions(1, 5)
    torch.manual_seed(0)
    own = [_model(8 + i, 16, 4) for i in range(8)]
    shared = _model(12, 24, 3)
    own_inputs = [torch.randn(5, 8 + i) for i in range(8)]
    shared_inputs = [torch.randn(5, 12) for _ in range(8)]
    with torch.no_grad():
        own_expected = [model(x) for model, x in zip(own, own_inputs, strict=True)]
        shared_expected = [shared(x) for x in shared_inputs]
    wrong = failed = 0
    compiles_per_key: collections.Counter[str] = collections.Counter()
    for round_ in range(rounds):
        monkeypatch.setenv("TPUCOMPILE_CACHE_DIR", str(cache_dir / f"round-{round_}"))  # nothing cached yet
        with fresh_start() as events:
            shared_compiled = torch.compile(shared, backend="tpucompile", dynamic=False)
            outcomes, errors = _run_together(
                [(lambda i=i: torch.compile(own[i], backend="tpucompile", dynamic=False), own_inputs[i],
                  own_expected[i]) for i in range(8)]
                + [(lambda compiled=shared_compiled: compiled, shared_inputs[i], shared_expected[i])
                   for i in range(8)]
            )
        assert not errors, errors
        wrong += outcomes.count(False)
        failed += len(errors)
        keys = {event.key for event in events}
        assert len(keys) == 9, f"{len(keys)} distinct programs for 9 models"
        compiled = collections.Counter(event.key for event in events if event.tier is None)
        assert set(compiled) == keys, "every model was compiled in this fresh start"
        compiles_per_key.update(compiled)
    report("threads", rounds=rounds, threads=16, models=9, failed=failed, wrong_results=wrong,
           most_compiles_of_one_model=max(compiles_per_key.values()) // rounds)
    assert wrong == 0 and failed == 0
    assert set(compiles_per_key.values()) == {rounds}, f"a model compiled more than once: {compiles_per_key}"


def _run_together(jobs: list) -> tuple[list[bool], list[BaseException]]:
    """Run each (compiled module maker, input, expected) job twice in a thread of its own, all released at
    once; whether each result was right, and what any thread raised."""
    start = threading.Barrier(len(jobs))
    outcomes: list[bool] = []
    errors: list[BaseException] = []

    def run(make, x: torch.Tensor, expected: torch.Tensor) -> None:
        try:
            torch._dynamo.config.recompile_limit = 64  # Dynamo's settings are per thread (context variables)
            start.wait()
            compiled = make()
            with torch.no_grad():
                for _ in range(2):
                    outcomes.append(torch.allclose(compiled(x), expected, atol=1e-5))
        except BaseException as error:  # reported by the caller, not lost in the thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes, errors
