"""Changing sequence lengths: compiles, total time and steady-state step time, per-size executables against
bucketed ones, against Inductor with ``dynamic=True`` and eager PyTorch, all in this one process.

    python bench/buckets.py                       # every workload
    python bench/buckets.py --workloads sweep15   # one

Workloads (a 2-layer Llama, ``examples/llama.py``, dim 256, random weights, batch 2):
- ``sweep15``: forward at 15 lengths from 5 to 127; ``sweep50``: at 50 lengths from 5 to 250;
- ``train``: forward, backward and an SGD step at 12 lengths from 9 to 200;
- ``generate``: greedy generation of 64 tokens from an 8-token prompt, the whole sequence run again for every
  new token (no KV cache), so every step is a new length;
- ``generate-cache``: the same with Hugging Face's ``LlamaForCausalLM`` (same sizes) and its key/value cache:
  one token per call, the cache growing by one (steady: a decoding step at cache length 100, the cache cut
  back to 100 after each timed call);
- ``serve-static``: a server's greedy decoding with that model and a static key/value cache
  (``transformers.StaticCache`` of 192 positions): prompts of 8 lengths from 5 to 100, 16 new tokens each
  (steady: a decoding step at cache position 100);
- ``bert``: Hugging Face's ``BertForMaskedLM`` (dim 256, 2 layers, 8 heads, 704 hidden), forward at the 15
  lengths of ``sweep15``;
- ``decode``: greedy decoding with the key/value cache at a server's sizes: ``LlamaForCausalLM`` of 4 layers,
  width 512 (8 heads, 4 key/value heads), 8 sequences, a prompt of 600 tokens, 60 new tokens (the cache
  grows from 600 to 660: bucket 1024), each step passing back the cache the previous one returned (every one
  a new size: the per-size backend compiles each). The backends decode side by side in one process, 5 steps
  each in turn, so that this machine's drift falls on all alike; steady: the median step after the first 10
  of each. ``tpucompile-bucket-repad`` is the bucketed backend with ``bucket_reuse_padded_results=False``;
  ``tpucompile-bucket-quarters`` (not run unless named) takes four buckets an octave (``QUARTER_OCTAVES``).
Each backend starts with Dynamo reset, tpucompile's in-process caches cleared and its persistent cache off, so
every executable counts as a compile; Inductor's cache is a new directory per run. Steady-state figures are
taken once tpucompile's background host-kernel checks are decided.
The sequence dimension is marked dynamic from the first call, as ``torch._dynamo.mark_dynamic`` does.
Steady state: the median of 30 calls at one length (100, bucket 128) after the sweep, against the same
backend's exact-size executable where it has one; then the same at length 128 (the forward workloads' "at
128" column), where the exact-size program shows what padding 100 rows to 128 costs by itself. Then XLA's
TPU estimate of the same programs at length 100 (``--tpu-target``, compiled here with libtpu): the measure
that counts, since the CPU is where we test.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

from llama import Llama, LlamaConfig

from tpucompile.artifacts import stores
from tpucompile.driver import host_kernel_upgrades
from tpucompile.metrics import compile_stats as stats

QUARTER_OCTAVES = (16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)
"""A finer ladder than the default powers of two: four buckets an octave, so a size is padded by at most a
quarter of its octave (100 -> 112 rather than 128), at the price of more compiles."""

BACKENDS = {
    "tpucompile-exact": dict(backend="tpucompile", options={"dynamic_mode": "exact", "cache_mode": "off"}),
    "tpucompile-bucket": dict(backend="tpucompile", options={"dynamic_mode": "bucket", "cache_mode": "off"}),
    "tpucompile-bucket-repad": dict(backend="tpucompile", options={
        "dynamic_mode": "bucket", "cache_mode": "off", "bucket_reuse_padded_results": False}),
    "tpucompile-bucket-quarters": dict(backend="tpucompile", options={
        "dynamic_mode": "bucket", "cache_mode": "off", "buckets": QUARTER_OCTAVES}),
    "inductor-dynamic": dict(backend="inductor", dynamic=True),
    "eager": None,
}
LENGTHS = {
    "sweep15": [5, 13, 21, 29, 37, 45, 53, 61, 69, 77, 85, 93, 101, 115, 127],
    "sweep50": [5 + 5 * k for k in range(50)],
    "train": [9, 17, 30, 41, 55, 64, 77, 90, 111, 130, 160, 200],
}
BATCH = 2
STEADY_LENGTH = 100
STEADY_BUCKET = 128
"""The default bucket of ``STEADY_LENGTH``: each backend's step is also timed at this length, every row used,
so that the padding's own cost (the exact-size program at 128 against 100) is measured beside the bucketed
step: no program padded to the bucket can beat it by padding alone."""


def model() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=1024, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, hidden_dim=704,
                             max_seq_len=512))


def _tokens(length: int) -> torch.Tensor:
    tokens = torch.randint(0, 1024, (BATCH, length))
    torch._dynamo.mark_dynamic(tokens, 1)
    return tokens


def _compiled(net: torch.nn.Module, backend: str):
    spec = BACKENDS[backend]
    if spec is None:
        return net
    return torch.compile(net, **spec)


def _compiles(backend: str) -> int | None:
    if not backend.startswith("tpucompile"):
        return None
    return stats.snapshot()["total"]["compiles"]


def _settled(call) -> None:
    """Run ``call`` until the host-kernel checks of its programs are decided (compiled in the background, then
    timed on its calls), so that steady-state figures time the programs that stay. The first call compiles
    where the size is new, which is what schedules its check, so the wait comes after it."""
    call()
    host_kernel_upgrades.wait()
    for _ in range(host_kernel_upgrades.TRIAL_CALLS + 3):
        call()


def steady_in_turns(calls: dict[str, dict[str, Callable[[], None]]]) -> dict[str, dict[str, float]]:
    """Each backend's median time of each of its calls (30 each), taken in turns of three calls per backend
    and call, so that this machine's drift (10-20% between one backend's minute and the next's) falls on
    every figure alike. A call's ``after`` attribute, if any, runs untimed after each (a cache cut back). A
    backend whose graph Dynamo dropped since its own pass (each pass starts with Dynamo reset) traces and
    compiles again while it settles, before any timing."""
    for timed in calls.values():
        for call in timed.values():
            _settled(lambda call=call: (call(), getattr(call, "after", lambda: None)()))
    times = {(backend, name): [] for backend, timed in calls.items() for name in timed}
    for _ in range(10):
        for backend, timed in calls.items():
            for name, call in timed.items():
                after = getattr(call, "after", None)
                for _ in range(3):
                    start = time.perf_counter()
                    call()
                    times[backend, name].append(time.perf_counter() - start)
                    if after is not None:
                        after()
    return {backend: {name: 1e3 * statistics.median(times[backend, name]) for name in timed}
            for backend, timed in calls.items()}


def hf_llama() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=4, intermediate_size=704, max_position_embeddings=512)
    return transformers.LlamaForCausalLM(config).eval()


def hf_llama_decoder() -> torch.nn.Module:
    """The ``decode`` workload's model: big enough that a step's cache (8 x 4 x 660 x 64 per layer, keys and
    values) is what a step moves, not the Python around it."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=4, intermediate_size=1408, max_position_embeddings=1024)
    return transformers.LlamaForCausalLM(config).eval()


DECODE_BATCH, DECODE_PROMPT, DECODE_TOKENS, DECODE_UNTIMED, DECODE_TURN = 8, 600, 60, 10, 5


def decode_rows(backends: list[str]) -> list[dict]:
    """The ``decode`` workload: every backend decodes in turn, ``DECODE_TURN`` steps at a time, in this one
    process (each its own copy of the model and its own cache); per backend its total seconds (prompt, steps
    and compiles), compiles and median step after the first ``DECODE_UNTIMED``."""
    import copy

    torch._dynamo.reset()
    stores.clear_memory()
    stats.reset()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16 * len(backends))
    model = hf_llama_decoder()
    compiled = {backend: _compiled(copy.deepcopy(model), backend) for backend in backends}
    prompt = torch.randint(0, 1024, (DECODE_BATCH, DECODE_PROMPT))
    torch._dynamo.mark_dynamic(prompt, 1)
    outputs, totals, steps = {}, dict.fromkeys(backends, 0.0), {backend: [] for backend in backends}
    compiles = dict.fromkeys(backends, 0)
    with torch.no_grad():
        for backend in backends:
            before = _compiles(backend) or 0
            start = time.perf_counter()
            outputs[backend] = compiled[backend](input_ids=prompt, use_cache=True)
            totals[backend] += time.perf_counter() - start
            compiles[backend] += (_compiles(backend) or 0) - before
        for turn in range(0, DECODE_TOKENS, DECODE_TURN):
            for backend in backends:
                before = _compiles(backend) or 0
                for step in range(turn, turn + DECODE_TURN):
                    token = outputs[backend].logits[:, -1:].argmax(-1)
                    cache = outputs[backend].past_key_values
                    start = time.perf_counter()
                    outputs[backend] = compiled[backend](input_ids=token, past_key_values=cache, use_cache=True)
                    elapsed = time.perf_counter() - start
                    totals[backend] += elapsed
                    if step >= DECODE_UNTIMED:
                        steps[backend].append(elapsed)
                compiles[backend] += (_compiles(backend) or 0) - before
    return [{"workload": "decode", "backend": backend, "total_s": round(totals[backend], 2),
             "compiles": compiles[backend] if backend.startswith("tpucompile") else None,
             "steady_ms": round(1e3 * statistics.median(steps[backend]), 2)} for backend in backends]


def hf_bert() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                                     intermediate_size=704, max_position_embeddings=512)
    return transformers.BertForMaskedLM(config).eval()


def _generate_with_cache(compiled, prompt: torch.Tensor, tokens: int) -> torch.Tensor:
    out = compiled(input_ids=prompt, use_cache=True)
    generated = []
    for _ in range(tokens):
        token = out.logits[:, -1:].argmax(-1)
        generated.append(token)
        out = compiled(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(generated, 1)


SERVE_PROMPTS = [5, 12, 19, 27, 38, 50, 70, 100]
SERVE_CACHE = 192


def _serve_static(compiled, model: torch.nn.Module, prompt: torch.Tensor, tokens: int) -> torch.Tensor:
    """Greedy decoding of ``tokens`` tokens after ``prompt`` into a static cache, as a server does it."""
    import transformers

    cache = transformers.StaticCache(config=model.config, max_cache_len=SERVE_CACHE)
    length = prompt.shape[1]
    torch._dynamo.mark_dynamic(prompt, 1)
    out = compiled(input_ids=prompt, past_key_values=cache, use_cache=True, cache_position=torch.arange(length))
    generated = []
    for index in range(tokens):
        token = out.logits[:, -1:].argmax(-1)
        generated.append(token)
        out = compiled(input_ids=token, past_key_values=cache, use_cache=True,
                       cache_position=torch.tensor([length + index]))
    return torch.cat(generated, 1)


def _static_decode_call(compiled, model: torch.nn.Module) -> Callable[[], None]:
    """One decoding step at static-cache position ``STEADY_LENGTH``, the cache filled by a prompt first."""
    import transformers

    with torch.no_grad():
        cache = transformers.StaticCache(config=model.config, max_cache_len=SERVE_CACHE)
        compiled(input_ids=_tokens(STEADY_LENGTH), past_key_values=cache, use_cache=True,
                 cache_position=torch.arange(STEADY_LENGTH))
    token, position = torch.randint(0, 1024, (BATCH, 1)), torch.tensor([STEADY_LENGTH])

    def decode() -> None:
        with torch.no_grad():
            compiled(input_ids=token, past_key_values=cache, use_cache=True, cache_position=position)

    return decode


def _dynamic_decode_call(compiled, length: int) -> Callable[[], None]:
    """One decoding step at cache length ``length``, the cache cut back to it after each step (untimed)."""
    with torch.no_grad():
        cache = compiled(input_ids=_tokens(length), use_cache=True).past_key_values
    token = torch.randint(0, 1024, (BATCH, 1))

    def decode() -> None:
        with torch.no_grad():
            compiled(input_ids=token, past_key_values=cache, use_cache=True)

    def cut_back() -> None:
        cache.crop(-1)

    decode.after = cut_back  # type: ignore[attr-defined]
    return decode


def run(workload: str, backend: str) -> tuple[dict, dict[str, Callable[[], None]]]:
    """One backend's pass over a workload: its row (total seconds, compiles) and the calls whose steady time
    ``steady_in_turns`` takes beside the other backends': ``steady_ms`` (length ``STEADY_LENGTH``, or a
    decoding step at that cache length) and, for the forward and training workloads, ``steady_at_bucket_ms``
    (length ``STEADY_BUCKET``)."""
    torch._dynamo.reset()
    stores.clear_memory()  # no executable of an earlier workload or backend is reused
    stats.reset()
    if workload == "generate-cache":
        compiled = _compiled(hf_llama(), backend)
        start = time.perf_counter()
        with torch.no_grad():
            _generate_with_cache(compiled, torch.randint(0, 1024, (BATCH, 8)), 64)
        total = time.perf_counter() - start
        compiles = _compiles(backend)
        return ({"workload": workload, "backend": backend, "total_s": round(total, 2), "compiles": compiles},
                {"steady_ms": _dynamic_decode_call(compiled, STEADY_LENGTH)})
    if workload == "serve-static":
        net = hf_llama()
        compiled = _compiled(net, backend)
        start = time.perf_counter()
        with torch.no_grad():
            for length in SERVE_PROMPTS:
                _serve_static(compiled, net, _tokens(length), 16)
        total = time.perf_counter() - start
        compiles = _compiles(backend)
        return ({"workload": workload, "backend": backend, "total_s": round(total, 2), "compiles": compiles},
                {"steady_ms": _static_decode_call(compiled, net)})
    net = hf_bert() if workload == "bert" else model()
    compiled = _compiled(net, backend)
    if workload == "train":
        optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)

        def step(tokens: torch.Tensor) -> None:
            loss = compiled(tokens).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    else:
        def step(tokens: torch.Tensor) -> None:
            with torch.no_grad():
                compiled(tokens)

    start = time.perf_counter()
    if workload == "generate":
        sequence = torch.randint(0, 1024, (BATCH, 8))
        with torch.no_grad():
            for _ in range(64):
                torch._dynamo.mark_dynamic(sequence, 1)
                logits = compiled(sequence)[:, -1]
                sequence = torch.cat([sequence, logits.argmax(-1, keepdim=True)], dim=1)
    else:
        for length in LENGTHS["sweep15" if workload == "bert" else workload]:
            step(_tokens(length))
    total = time.perf_counter() - start
    compiles = _compiles(backend)
    row = {"workload": workload, "backend": backend, "total_s": round(total, 2), "compiles": compiles}
    steady, at_bucket = _tokens(STEADY_LENGTH), _tokens(STEADY_BUCKET)
    return row, {"steady_ms": lambda: step(steady), "steady_at_bucket_ms": lambda: step(at_bucket)}


def _keep_target_events(events: list, event: object) -> None:
    if getattr(event, "target", None):
        events.append(event)


def tpu_costs(target: str) -> list[dict]:
    """XLA's TPU estimate for ``target`` (compiled here, not run) of the forward and of a training step's
    programs at length 100: the exact-size executable, the bucketed one (bucket 128, lowered as a TPU host
    lowers it), the bucketed one with merged views left to XLA's padder (``bucket_unmerged_products=False``)
    and the one with its results copied to fixed shapes (``bucket_fixed_shapes_in_place=False``)."""
    from tpucompile import driver

    # a TPU host lowers with bucket_products_on_padding=False (its "auto"); this machine would lower for the CPU
    tpu = {"dynamic_mode": "bucket", "bucket_products_on_padding": False}
    modes = {"exact": {"dynamic_mode": "exact"}, "bucket": tpu,
             "bucket, merged views": {**tpu, "bucket_unmerged_products": False},
             "bucket, results copied": {**tpu, "bucket_fixed_shapes_in_place": False}}
    rows = []
    for mode, options in modes.items():
        for training in (False, True):
            torch._dynamo.reset()
            stores.clear_memory()
            events: list = []
            remove = driver.add_observer(functools.partial(_keep_target_events, events))
            try:
                net = model()
                compiled = torch.compile(net, backend="tpucompile",
                                         options={**options, "cache_mode": "off", "targets": [target]})
                for length in (97, STEADY_LENGTH):  # a bucketed graph compiles its bucket at the first
                    if training:
                        compiled(_tokens(length)).float().pow(2).mean().backward()
                    else:
                        with torch.no_grad():
                            compiled(_tokens(length))
            finally:
                remove()
            last = {event.name: event for event in events}  # per graph, its program for the last length
            for event in last.values():
                rows.append({"mode": mode, "graph": event.name.split("(")[-1].rstrip(")"),
                             "cycles": event.report.get("estimated_cycles"),
                             "bytes_accessed": event.report.get("bytes_accessed"), "flops": event.report.get("flops")})
    return rows


def tpu_decode_costs(target: str) -> list[dict]:
    """XLA's TPU estimate for ``target`` of the ``decode`` workload's decoding step at cache length 660: the
    exact-size executable, the bucketed one (bucket 1024; the cache grown in its own buffer), the bucketed
    one that pads the cache anew (``bucket_reuse_padded_results=False``), and the step with a static cache of
    1024 positions instead."""
    import transformers

    from tpucompile import driver

    tpu = {"dynamic_mode": "bucket", "bucket_products_on_padding": False}
    modes = {"exact": {"dynamic_mode": "exact"}, "bucket": tpu,
             "bucket, cache padded anew": {**tpu, "bucket_reuse_padded_results": False}}
    rows = []
    for mode, options in modes.items():
        torch._dynamo.reset()
        stores.clear_memory()
        events: list = []
        remove = driver.add_observer(functools.partial(_keep_target_events, events))
        try:
            compiled = torch.compile(hf_llama_decoder(), backend="tpucompile",
                                     options={**options, "cache_mode": "off", "targets": [target]})
            for length in (DECODE_PROMPT + DECODE_TOKENS - 1, DECODE_PROMPT + DECODE_TOKENS):
                cache = transformers.DynamicCache()
                for layer in range(4):
                    keys, values = (torch.randn(DECODE_BATCH, 4, length, 64) for _ in range(2))
                    torch._dynamo.mark_dynamic(keys, 2)
                    torch._dynamo.mark_dynamic(values, 2)
                    cache.update(keys, values, layer)
                with torch.no_grad():
                    compiled(input_ids=torch.randint(0, 1024, (DECODE_BATCH, 1)), past_key_values=cache, use_cache=True)
        finally:
            remove()
        event = events[-1]  # the program for the last length
        rows.append({"mode": mode, "graph": "decoding step", "cycles": event.report.get("estimated_cycles"),
                     "bytes_accessed": event.report.get("bytes_accessed"), "flops": event.report.get("flops")})
    rows.append(_tpu_static_decode_cost(target))
    return rows


def _tpu_static_decode_cost(target: str) -> dict:
    """XLA's TPU estimate for ``target`` of the same model's decoding step at position 660 of a static cache of
    1024 positions (``transformers.StaticCache``: every step reads the whole cache, updated in place)."""
    import transformers

    from tpucompile import driver

    torch._dynamo.reset()
    stores.clear_memory()
    events: list = []
    model = hf_llama_decoder()
    compiled = torch.compile(model, backend="tpucompile", options={"cache_mode": "off", "targets": [target]})
    cache = transformers.StaticCache(config=model.config, max_cache_len=1024)
    length = DECODE_PROMPT + DECODE_TOKENS
    with torch.no_grad():
        compiled(input_ids=torch.randint(0, 1024, (DECODE_BATCH, length)), past_key_values=cache, use_cache=True,
                 cache_position=torch.arange(length))
        remove = driver.add_observer(functools.partial(_keep_target_events, events))
        try:
            compiled(input_ids=torch.randint(0, 1024, (DECODE_BATCH, 1)), past_key_values=cache, use_cache=True,
                     cache_position=torch.tensor([length]))
        finally:
            remove()
    report = events[-1].report
    return {"mode": "static cache 1024", "graph": "decoding step", "cycles": report.get("estimated_cycles"),
            "bytes_accessed": report.get("bytes_accessed"), "flops": report.get("flops")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="sweep15,sweep50,train,generate,generate-cache,serve-static,bert")
    parser.add_argument("--backends", default=",".join(
        b for b in BACKENDS if b not in ("tpucompile-bucket-repad", "tpucompile-bucket-quarters")))
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--tpu-target", default="tpu:v5e:1x1",
                        help="also report XLA's TPU estimate for this target at length 100 ('' to skip)")
    args = parser.parse_args()
    # Inductor compiles cold in every run, as tpucompile does with its persistent cache off.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="buckets-inductor-")
    rows = []
    for workload in filter(None, args.workloads.split(",")):
        if workload == "decode":
            for row in decode_rows(args.backends.split(",")):
                rows.append(row)
                print(json.dumps(row), flush=True)
            continue
        calls, workload_rows = {}, []
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16 * len(BACKENDS))
        for backend in args.backends.split(","):
            row, calls[backend] = run(workload, backend)
            workload_rows.append(row)
        steady = steady_in_turns(calls)
        for row in workload_rows:
            row.update({name: round(ms, 2) for name, ms in steady[row["backend"]].items()})
        for row in workload_rows:
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(f"{'workload':10} {'backend':26} {'compiles':>8} {'total s':>8} {'steady ms':>9} "
          f"{f'at {STEADY_BUCKET} ms':>9}  ratios in the workload")
    for row in rows:
        same = {r["backend"]: r for r in rows if r["workload"] == row["workload"]}
        exact = same.get("tpucompile-exact")
        ratios = ""
        if exact is not None and row["backend"] != "tpucompile-exact":
            ratios = (f"total {row['total_s'] / exact['total_s']:.2f}x of exact, "
                      f"step {row['steady_ms'] / exact['steady_ms']:.2f}x of exact")
        elif exact is not None and exact.get("steady_at_bucket_ms"):
            ratios = (f"the padding's own cost: exact at {STEADY_BUCKET} is "
                      f"{exact['steady_at_bucket_ms'] / exact['steady_ms']:.2f}x of exact at {STEADY_LENGTH}")
        compiles = "-" if row["compiles"] is None else row["compiles"]
        at_bucket = row.get("steady_at_bucket_ms")
        at_bucket = "-" if at_bucket is None else f"{at_bucket:.2f}"
        print(f"{row['workload']:10} {row['backend']:26} {compiles:>8} {row['total_s']:>8.2f} "
              f"{row['steady_ms']:>9.2f} {at_bucket:>9}  {ratios}")
    costs = tpu_costs(args.tpu_target) if args.tpu_target else []
    if args.tpu_target and "decode" in args.workloads.split(","):
        costs += tpu_decode_costs(args.tpu_target)
    if costs:
        print(f"\nXLA's estimate for {args.tpu_target} at length {STEADY_LENGTH}, the decoding step at cache length "
              f"{DECODE_PROMPT + DECODE_TOKENS} (cycles, sum over the entry's instructions; bytes accessed)")
        exact = {row["graph"]: row for row in costs if row["mode"] == "exact"}
        for row in costs:
            base = exact.get(row["graph"])
            ratio = f"{row['cycles'] / base['cycles']:.2f}x of exact" if base and base["cycles"] else ""
            print(f"{row['mode']:22} {row['graph']:10} {row['cycles']:>10} cycles {row['bytes_accessed']:.3g} "
                  f"bytes  {ratio}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"rows": rows, "tpu": costs}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
