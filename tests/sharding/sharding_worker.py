"""Sharded runs that need several devices, run by ``test_sharding.py`` in fresh processes (XLA's virtual CPU
device count must be set before jax starts); each prints one JSON line.

    python sharding_worker.py gpt                 # 8 devices: GPT inference and 3 AdamW steps under DP, TP,
                                                  # DP x TP, against one device and eager
    python sharding_worker.py host ID PORT DIR [PLAN]  # one of 2 processes x 4 devices sharing a mesh
                                                  # (PLAN: dp_tp, the default, or fsdp)
    python sharding_worker.py dtensor ID PORT DIR # one of 2 processes (torch ranks) x 1 device: DTensor inputs
    python sharding_worker.py attention           # 8 devices: the attention kernel (interpret mode) per shard
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time

DEVICES = {"gpt": 8, "host": 4, "dtensor": 1, "attention": 8}[sys.argv[1]]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"

import torch  # noqa: E402

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPOSITORY, "examples"))

from mingpt import GPT, GPTConfig  # noqa: E402

import tpucompile  # noqa: E402
from tpucompile import Mesh, data_parallel, driver, fully_sharded, tensor_parallel  # noqa: E402

CONFIG = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=64)
BATCH, LENGTH, STEPS = 8, 16, 3
COLUMN = ["blocks.*.attn.qkv", "blocks.*.mlp.0"]
ROW = ["blocks.*.attn.proj", "blocks.*.mlp.2"]


def plans() -> dict[str, tuple[Mesh, tpucompile.ShardPlan]]:
    dp, tp, both = Mesh({"data": 8}), Mesh({"model": 8}), Mesh({"data": 2, "model": 4})
    return {
        "dp": (dp, data_parallel(dp)),
        "tp": (tp, tensor_parallel(tp, column=COLUMN, row=ROW)),
        "dp_tp": (both, data_parallel(both) + tensor_parallel(both, column=COLUMN, row=ROW)
                  + tpucompile.ShardPlan.from_mapping({"blocks.*.mlp:output": ("data", None, None)})),
    }


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    idx = torch.randint(0, CONFIG.vocab_size, (BATCH, LENGTH), generator=generator)
    targets = torch.randint(0, CONFIG.vocab_size, (BATCH, LENGTH), generator=generator)
    return idx, targets


def run(model: torch.nn.Module, options: dict | None) -> dict:
    """Logits, then STEPS AdamW steps: what a run produced, to be compared across layouts."""
    net = torch.compile(model, backend="tpucompile", options=options) if options is not None else model
    idx, targets = data()
    with torch.no_grad():
        logits = net(idx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = net(idx, targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"logits": logits, "losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


def max_diff(a: list[torch.Tensor] | torch.Tensor, b: list[torch.Tensor] | torch.Tensor) -> float:
    if isinstance(a, torch.Tensor):
        return (a - b).abs().max().item()
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def compare(run_a: dict, run_b: dict) -> dict:
    return {
        "logits": (run_a["logits"] - run_b["logits"]).abs().max().item(),
        "losses": max(abs(x - y) for x, y in zip(run_a["losses"], run_b["losses"], strict=True)),
        "params": max_diff(run_a["params"], run_b["params"]),
    }


def gpt() -> None:
    torch.manual_seed(0)
    initial = GPT(CONFIG)
    events: list = []
    driver.add_observer(events.append)
    eager = run(copy.deepcopy(initial), None)
    start = time.perf_counter()
    single = run(copy.deepcopy(initial), {})
    report = {"single": {"vs_eager": compare(single, eager), "seconds": time.perf_counter() - start,
                         "losses": single["losses"]}}
    for name, (mesh, plan) in plans().items():
        torch._dynamo.reset()
        events.clear()
        start = time.perf_counter()
        sharded = run(copy.deepcopy(initial), {"mesh": mesh, "shard": plan})
        seconds = time.perf_counter() - start
        sharded_exe = [e for e in driver.recent_executables() if type(e).__name__ == "ShardedExecutable"]
        report[name] = {
            "vs_single": compare(sharded, single),
            "vs_eager": compare(sharded, eager),
            "losses": sharded["losses"],
            "seconds": seconds,
            "keys": sorted(e.key for e in events),
            "sharded_in_stablehlo": all("sdy.sharding" in e.program.text() for e in events),
            "constraints": [e.program.text().count("sdy.sharding_constraint") for e in events],
            "collectives": [collectives(e.executable) for e in events],
            "executables": len(sharded_exe),
        }
    report["reuse"] = reuse()
    report["kept_output"] = kept_output()
    report["fsdp"] = fully_sharded_runs(initial)
    report["memory"] = mesh_memory()
    print(json.dumps(report))


def training_run(model: torch.nn.Module, options: dict) -> dict:
    """Logits, the first step's gradients, then STEPS AdamW steps with the optimiser step compiled too."""
    net = torch.compile(model, backend="tpucompile", options=options)
    idx, targets = data()
    with torch.no_grad():
        logits = net(idx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = torch.compile(optimizer.step, backend="tpucompile", options=options)
    losses, gradients = [], None
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = net(idx, targets)
        loss.backward()
        gradients = gradients or [p.grad.clone() for p in model.parameters()]
        step()
        losses.append(loss.item())
    return {"logits": logits, "losses": losses, "gradients": gradients,
            "params": [p.detach().clone() for p in model.parameters()],
            "state": [t.clone() for s in optimizer.state.values() for t in (s["exp_avg"], s["exp_avg_sq"])]}


def fully_sharded_runs(initial: torch.nn.Module) -> dict:
    """FSDP over 8 devices (the ``shard`` option's string form) and FSDP x TP on a 2 x 4 mesh, against one
    device; what each program returns split, and the collectives XLA put in."""
    torch._dynamo.reset()
    single = training_run(copy.deepcopy(initial), {})
    both = Mesh({"data": 2, "model": 4})
    layouts = {
        "fsdp": {"mesh": Mesh({"data": 8}), "shard": "fsdp"},
        "fsdp_tp": {"mesh": both, "shard": fully_sharded(both) + tensor_parallel(both, column=COLUMN, row=ROW)},
        "fsdp_rolled": {"mesh": Mesh({"data": 8}), "shard": "fsdp", "roll_layers": True},
    }
    report = {}
    for name, options in layouts.items():
        torch._dynamo.reset()
        events: list = []
        remove = driver.add_observer(events.append)
        before = {id(e) for e in driver.recent_executables()}
        sharded = training_run(copy.deepcopy(initial), options)
        remove()
        split = [sum(1 for dims in e.result_dims if dims and any(dims)) for e in driver.recent_executables()
                 if id(e) not in before and type(e).__name__ == "ShardedExecutable"]
        report[name] = {
            "vs_single": {key: max_diff(sharded[key], single[key]) if key != "losses" else
                          max(abs(x - y) for x, y in zip(sharded[key], single[key], strict=True))
                          for key in ("logits", "losses", "gradients", "params", "state")},
            "graphs": [e.name for e in events],
            "results_split": split,
            "collectives": [collective_kinds(e.executable) for e in events],
            "parameters": len(single["params"]),
            "layer_parts": [sum(slot.part is not None for slot in e.program.output_plan) for e in events],
        }
    report["prewarm_keys"] = prewarm_keys()
    return report


def prewarm_keys() -> dict:
    """FSDP compiled for a v5e slice of 8 chips twice: compile-only on meta weights, and running here on 8
    devices with real weights: the slice's executable keys of every graph (forward, backward, AdamW's step)."""
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        return {"skipped": "libtpu is not installed"}
    found = {}
    for device in ("meta", "cpu"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        with torch.device(device):
            model = GPT(CONFIG)
        idx = torch.zeros(BATCH, LENGTH, dtype=torch.long, device=device)
        options = {"targets": ["tpu:v5e:2x4"], "mesh": Mesh({"data": 8}), "shard": "fsdp", "cache_mode": "off"}
        events: list = []
        remove = driver.add_observer(events.append)
        torch.compile(model, backend="tpucompile", options=options)(idx, idx).backward()
        torch.compile(torch.optim.AdamW(model.parameters(), lr=1e-3).step, backend="tpucompile", options=options)()
        remove()
        found[device] = [(e.name.rsplit("(", 1)[-1].rstrip(")"), e.key, e.error) for e in events
                         if e.target == "tpu:v5e:2x4"]
    return found


def collective_kinds(executable) -> dict[str, int]:
    text = "\n".join(m.to_string() for m in executable.hlo_modules())
    return {op: text.count(f" {op}(") for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")}


def collectives(executable) -> int:
    """How many collective ops XLA's partitioner put in an executable's optimised HLO."""
    text = "\n".join(m.to_string() for m in executable.hlo_modules())
    ops = ("all-reduce(", "all-gather(", "reduce-scatter(", "collective-permute(", "all-to-all(")
    return sum(text.count(op) for op in ops)


def reuse() -> dict:
    """Inference twice with the same weights: the second call places only the input, not the parameters."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    mesh = Mesh({"data": 2, "model": 4})
    model = GPT(CONFIG)
    compiled = torch.compile(model, backend="tpucompile",
                             options={"mesh": mesh, "shard": tensor_parallel(mesh, column=COLUMN, row=ROW)})
    idx, _ = data()
    with torch.no_grad():
        compiled(idx)
        executable = driver.recent_executables()[-1]
        first = executable.placements
        compiled(idx + 1)
        second = executable.placements - first
        with torch.no_grad():
            model.ln_f.weight.add_(1.0)
        compiled(idx)
        third = executable.placements - first - second
    return {"first": first, "second": second, "after_update": third,
            "parameters": len(list(model.parameters()))}


def kept_output() -> dict:
    """An output the plan keeps split: it comes back whole to torch, and a second program that takes it split
    the same way uses the device parts as they are."""
    torch._dynamo.reset()
    mesh = Mesh({"data": 8})
    layer = torch.nn.Linear(16, 16)
    first = torch.compile(layer, backend="tpucompile",
                          options={"mesh": mesh, "shard": data_parallel(mesh) + tpucompile.ShardPlan.from_mapping(
                              {"output:0": ("data", None)})})
    second = torch.compile(torch.tanh, backend="tpucompile", options={"mesh": mesh, "shard": data_parallel(mesh)})
    x = torch.randn(32, 16)
    with torch.no_grad():
        hidden = first(x)
        producer = driver.recent_executables()[-1]
        out = second(hidden)
        consumer = driver.recent_executables()[-1]
        expected = torch.tanh(layer(x))
    return {"diff": (out - expected).abs().max().item(), "dims": producer.result_dims[0],
            "consumer_placements": consumer.placements}


def mesh_memory() -> dict:
    """Models compiled over a data-parallel mesh, run and dropped in turn: each one's parameter shards are
    counted on every device while it lives, and nothing stays held after it goes."""
    import gc
    import weakref

    mesh = Mesh({"data": 8})
    held, alive, parameters = [], [], []
    for index in range(5):
        torch._dynamo.reset()
        torch.manual_seed(index)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        compiled = torch.compile(model, backend="tpucompile", options={"mesh": mesh, "shard": data_parallel(mesh)})
        compiled(torch.randn(32, 64)).square().mean().backward()
        gc.collect()
        alive.append(tpucompile.memory_stats()["held"]["parameters"])
        parameters.append(sum(p.nbytes for p in model.parameters()))
        reference = weakref.ref(model[0].weight)
        del model, compiled
        torch._dynamo.reset()
        gc.collect()
        held.append(tpucompile.memory_stats()["held"])
        alive[-1] = (alive[-1], reference() is None)
    return {"held_after": held, "parameters_while_alive": alive, "parameter_bytes": parameters}


def host(process_id: int, port: int, cache_dir: str, plan: str = "dp_tp") -> None:
    """One of two processes with 4 CPU devices each, sharing a 2 x 4 mesh through jax.distributed, under
    DP x TP or under FSDP (every parameter split over the 8 devices, half in each process)."""
    torch.manual_seed(0)
    initial = GPT(CONFIG)
    mesh = Mesh({"data": 2, "model": 4}) if plan == "dp_tp" else Mesh({"data": 8})
    options = {
        "mesh": mesh,
        "shard": data_parallel(mesh) + tensor_parallel(mesh, column=COLUMN, row=ROW) if plan == "dp_tp" else "fsdp",
        "coordinator": f"127.0.0.1:{port}",
        "num_processes": 2,
        "process_id": process_id,
        "cache_dir": cache_dir,
    }
    events: list = []
    driver.add_observer(events.append)
    sharded = run(copy.deepcopy(initial), options)
    eager = run(copy.deepcopy(initial), None)
    import jax

    print(json.dumps({
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "local_devices": jax.local_device_count(),
        "devices": jax.device_count(),
        "vs_eager": compare(sharded, eager),
        "losses": sharded["losses"],
        "compiles": [{"key": e.key, "hit": e.cache_hit, "tier": e.tier} for e in events],
    }), flush=True)


def dtensor(rank: int, port: int, cache_dir: str) -> None:
    """A tensor-parallel MLP whose parameters are DTensors on a 2-rank mesh: their placements are the plan."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("model",))
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    x = torch.randn(8, 16)

    def distributed(model: torch.nn.Module) -> torch.nn.Module:
        model = copy.deepcopy(model)
        layout = {"0.weight": [Shard(0)], "0.bias": [Shard(0)], "2.weight": [Shard(1)], "2.bias": [Replicate()]}
        for name, placements in layout.items():
            module, attr = name.split(".")
            value = getattr(model[int(module)], attr).detach()
            setattr(model[int(module)], attr, torch.nn.Parameter(distribute_tensor(value, mesh, placements)))
        return model

    events: list = []
    driver.add_observer(events.append)
    report: dict = {"rank": rank}
    results = {}
    for name in ("eager", "compiled"):
        model = distributed(plain)
        net = model if name == "eager" else torch.compile(model, backend="tpucompile",
                                                          options={"cache_dir": cache_dir})
        inputs = distribute_tensor(x, mesh, [Replicate()])
        with torch.no_grad():
            out = net(inputs)
        report[f"{name}_output_type"] = type(out).__name__
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(STEPS):
            optimizer.zero_grad()
            loss = net(inputs).pow(2).mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.full_tensor().item() if isinstance(loss, DTensor) else loss.item())
        report[f"{name}_grad_type"] = type(model[0].weight.grad).__name__
        report[f"{name}_grad_placements"] = str(getattr(model[0].weight.grad, "placements", None))
        results[name] = {"out": out.full_tensor() if isinstance(out, DTensor) else out, "losses": losses,
                         "params": [p.full_tensor() for p in model.parameters()]}
    report["output"] = (results["compiled"]["out"] - results["eager"]["out"]).abs().max().item()
    report["losses"] = [results["eager"]["losses"], results["compiled"]["losses"]]
    report["params"] = max_diff(results["compiled"]["params"], results["eager"]["params"])
    report["sharded_programs"] = sum('sdy.sharding<@mesh, [{"model"}, {}]>' in e.program.text() for e in events)
    print(json.dumps(report), flush=True)
    dist.destroy_process_group()


def attention_kernel() -> None:
    """Grouped-query causal attention with a padding mask through the splash kernel (Pallas' interpret mode,
    so it runs here) on meshes that split the batch, the heads, both, or neither (a batch of 2 on 8 devices),
    against the same on one device and eager: output and gradients of query, key and value, and how each
    program splits the kernel's operands."""
    import torch.nn.functional as F

    def attend(q, k, v, valid, weights):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], is_causal=False,
                                             enable_gqa=True)
        return (out.float() * weights).sum()

    def inputs(batch: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(2)
        q = torch.randn(batch, 8, 128, 128, generator=generator)
        k, v = (torch.randn(batch, 4, 128, 128, generator=generator) for _ in range(2))
        valid = torch.ones(batch, 128, dtype=torch.bool)
        valid[0, 100:] = False  # a padded row
        return [q, k, v, valid, torch.randn(batch, 8, 128, 128, generator=generator)]

    def run(batch: int, options: dict) -> dict:
        torch._dynamo.reset()
        tensors = [t.clone().requires_grad_(t.is_floating_point() and i < 3) for i, t in enumerate(inputs(batch))]
        events: list = []
        remove = driver.add_observer(events.append)
        try:
            fn = attend if options is None else torch.compile(attend, backend="tpucompile", fullgraph=True,
                                                                 options={"attention": "interpret", **options})
            loss = fn(*tensors)
            loss.backward()
        finally:
            remove()
        texts = [e.program.text() for e in events]
        return {"values": [loss.detach()] + [t.grad for t in tensors[:3]],
                "manual": [text.count("sdy.manual_computation") for text in texts],
                "kernel": [("splash_interpreted" in text) for text in texts],
                "local_query": [_local_query_shape(text) for text in texts]}

    report = {}
    for name, batch, mesh in (("data", 8, Mesh({"data": 8})), ("heads", 8, Mesh({"model": 4})),
                              ("both", 8, Mesh({"data": 2, "model": 4})), ("neither", 2, Mesh({"data": 8}))):
        eager = run(batch, None)
        single = run(batch, {})
        sharded = run(batch, {"mesh": mesh, "shard": data_parallel(mesh) if "data" in mesh.axis_names else
                              tpucompile.ShardPlan.from_mapping({}, mesh)})
        report[name] = {"vs_single": max_diff(sharded["values"], single["values"]),
                        "vs_eager": max_diff(sharded["values"], eager["values"]),
                        **{k: sharded[k] for k in ("manual", "kernel", "local_query")}}
    print(json.dumps(report))


def _local_query_shape(text: str) -> list[int] | None:
    """The query block the kernel function of a program is lowered for (its first argument's shape)."""
    import re

    found = re.search(r"func\.func private @jax_attention[a-z_]*_splash_interpreted_[0-9a-f]+\(%arg0: "
                      r"tensor<([0-9x]+)x[a-z0-9]+>", text)
    return None if found is None else [int(n) for n in found.group(1).split("x")]


if __name__ == "__main__":
    if sys.argv[1] == "gpt":
        gpt()
    elif sys.argv[1] == "attention":
        attention_kernel()
    elif sys.argv[1] == "host":
        host(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], *sys.argv[5:])
    else:
        dtensor(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    sys.stdout.flush()
