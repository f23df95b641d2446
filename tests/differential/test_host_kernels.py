"""Differential test of the CPU host kernels (``host_blas``: BLAS sgemm for matrix products, im2col/col2im for
f32 convolutions): whole networks compiled with ``options={"host_kernels": "on"}`` and ``"off"`` (XLA's own
dots and convolutions) must compute the same forward and backward pass.

Cases: every example model of ``examples/`` (small configurations by default; in full mode their ``main()``
sizes, and DenseNet-121's layout on 8 images of 64x64) and seeded random networks from
``random_networks.generate`` (DenseNet-like concatenation chains, strided / dilated / grouped / depthwise /
transposed convolutions, BatchNorm in training mode, pooling, attention blocks with matmuls of many shapes and
transposes; channels-last, permuted, sliced and transposed inputs).

Each case runs four times from the same weights and inputs: eager in float64 (``eager64``), eager in float32
(``eager``), and compiled with the host kernels ``off`` and ``on``. The eager runs use ATen's own convolutions,
not oneDNN's: torch 2.13's oneDNN weight gradient of a strided 1x1 convolution on a channels-last input with few
channels writes out of bounds (uxlfoundation/oneDNN#6035; it corrupted the heap and crashed these runs).
Each run is one forward and one backward pass; the loss is a fixed random projection of the outputs, summed
(``sum_i <output_i, P_i>``, ``P_i`` seeded by the case's name). Compared tensors: every output, the gradient of
every floating input leaf and of every parameter, and every floating buffer after the pass (BatchNorm running
statistics).

Tolerance rule, per tensor T (maxima over its elements)::

    scale   = max(max|T_eager64|, CASE_SCALE * median over the case's tensors of max|T_eager64|)
    floor   = FLOOR * scale                               (FLOOR = 2e-5, CASE_SCALE = 1e-2)
    tol     = max(4 * max|T_eager - T_off|, floor)        (XLA's own distance from eager, with margin)
    tol_ref = max(4 * max|T_eager - T_eager64|, floor)    (eager float32's own rounding error, with margin)

    assert max|T_on  - T_off|   <= tol       the differential check
    assert max|T_on  - T_eager| <= tol       host kernels close to eager
    assert max|T_off - T_eager| <= tol_ref   XLA close to eager (tol itself would make this one vacuous)

So the host kernels may differ from XLA by as much as XLA differs from eager (four times over), never more.
``floor`` keeps a tensor on which eager and XLA happen to agree (nearly) exactly from demanding bitwise
agreement: float32 sums taken in another order differ by some 1e-7 to 1e-5 of the tensor's largest element
(what eager and XLA differ by on these networks), while a wrong kernel (a misplaced, missing or doubled
element) shows as errors of order 1e-2 to 1 of that scale. The
case's typical scale bounds ``scale`` from below for gradients that are small because their terms cancel
(a softmax's gradient sums to zero along its axis): their rounding noise is relative to the terms, not to the
result. The networks avoid mathematically zero gradients (no bias right before a BatchNorm, no key bias
before a softmax), which would be pure noise. Each case also checks that the "on" programs really call host
kernels and the "off" ones none (else the comparison would prove nothing), and prints how many products and
convolutions went to the kernels and how many stayed with XLA (``-rP`` shows it). A failure names the case
(kind and seed), what the generator drew, the tensor, the error, the worst element and its index, and the
tolerance with its parts.

Runs:

    pytest tests/differential                                   # default: examples (small) + seeds 0-3
    TPUCOMPILE_DIFFERENTIAL=full pytest tests/differential      # examples at full sizes + seeds 0-99
    TPUCOMPILE_DIFFERENTIAL=full TPUCOMPILE_DIFFERENTIAL_SEEDS=500 pytest tests/differential   # seeds 0-499
    TPUCOMPILE_DIFFERENTIAL_SEEDS=200-240 pytest tests/differential -k conv     # a range of seeds, one kind
    python tests/differential/random_networks.py 17               # what seed 17 builds

``TPUCOMPILE_DIFFERENTIAL_SEEDS`` is a count (``N``: seeds 0..N-1) or a range (``A-B``, B excluded), in either
mode.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import os
import re
import sys
import types
import zlib
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import torch

from tests.differential import random_networks
from tests.differential.random_networks import Case

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples")

FLOOR = 2e-5
"""The absolute floor of every tolerance, as a fraction of the tensor's scale."""
CASE_SCALE = 1e-2
"""A tensor's scale is its largest magnitude (float64 eager), but at least this fraction of the case's typical
scale (the median of its tensors' largest magnitudes)."""
MARGIN = 4.0
"""How many times the reference difference (eager vs XLA, eager vs float64) a difference may be."""

FULL = os.environ.get("TPUCOMPILE_DIFFERENTIAL", "").strip().lower() == "full"
DEFAULT_SEEDS, FULL_SEEDS = 4, 100
HOST_GEMM, HOST_CONV = "tpucompile_host_gemm", "tpucompile_host_conv"


def _seeds() -> range:
    text = os.environ.get("TPUCOMPILE_DIFFERENTIAL_SEEDS", "").strip()
    if not text:
        return range(FULL_SEEDS if FULL else DEFAULT_SEEDS)
    if "-" in text:
        start, stop = text.split("-", 1)
        return range(int(start), int(stop))
    return range(int(text))


# ----------------------------------------------------------------------------------------------------------
# The example models, as cases


def _example(name: str) -> types.ModuleType:
    """``examples/<name>.py`` as module ``tpucompile_example_<name>`` (its own ``measure`` import found)."""
    module_name = f"tpucompile_example_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, os.path.join(EXAMPLES, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, EXAMPLES)
        try:
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
        finally:
            sys.path.remove(EXAMPLES)
    return sys.modules[module_name]


def _examples() -> dict[str, Callable[[], Case]]:
    """Builders of the example models' cases: small configurations by default, ``main()``'s in full mode."""

    def mlp() -> Case:
        mlp = _example("mlp")

        width, depth, batch = (256, 4, 64) if FULL else (64, 2, 16)
        return Case("example-mlp", mlp.make_mlp(width, depth), (torch.randn(batch, width),))

    def resnet() -> Case:
        resnet = _example("resnet")

        config = resnet.ResNetConfig() if FULL else resnet.ResNetConfig(stem_width=8, widths=(8, 16))
        batch = 8 if FULL else 2
        images = torch.randn(batch, config.in_channels, config.image_size, config.image_size)
        return Case("example-resnet", resnet.ResNet(config), (images,))

    def unet() -> Case:
        unet = _example("unet")

        config = unet.UNetConfig() if FULL else unet.UNetConfig(image_size=16, base_width=4, up_modes=("transpose",))
        batch = 4 if FULL else 2
        images = torch.randn(batch, config.in_channels, config.image_size, config.image_size)
        return Case("example-unet", unet.UNet(config), (images,))

    def densenet() -> Case:
        densenet = _example("densenet")

        # Full: DenseNet-121's layout on 8 images of 64x64 (the benchmark's); small: its 64x64 images keep the
        # first block at 16x16, where the host kernels take the convolutions.
        config = densenet.DENSENET_121 if FULL else densenet.DenseNetConfig(image_size=64, stem_width=8, growth=4,
                                                                             blocks=(2, 2))
        batch = 8 if FULL else 2
        images = torch.randn(batch, config.in_channels, config.image_size, config.image_size)
        return Case("example-densenet", densenet.DenseNet(config), (images,))

    def dlrm() -> Case:
        dlrm = _example("dlrm")

        config = dlrm.DLRMConfig() if FULL else dlrm.DLRMConfig(
            table_sizes=(20, 8, 30), embedding_dim=8, bottom_mlp=(16,), top_mlp=(16,))
        batch = 32 if FULL else 8
        dense, indices, offsets, _ = dlrm.make_batch(config, batch, torch.Generator().manual_seed(1))
        tables = len(config.table_sizes)
        return Case("example-dlrm", dlrm.DLRM(config), (dense, *indices, *offsets),
                    lambda t: (t[0], list(t[1 : 1 + tables]), list(t[1 + tables :])))

    def mingpt() -> Case:
        mingpt = _example("mingpt")

        config = mingpt.GPTConfig() if FULL else mingpt.GPTConfig(vocab_size=64, block_size=16, n_layer=1,
                                                                   n_head=2, n_embd=32)
        batch = 4 if FULL else 2
        tokens = torch.randint(0, config.vocab_size, (batch, config.block_size))
        return Case("example-mingpt", mingpt.GPT(config), (tokens,))

    def llama() -> Case:
        llama = _example("llama")

        config = llama.LlamaConfig() if FULL else llama.LlamaConfig(
            vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=16)
        batch, length = (4, 32) if FULL else (2, 16)
        tokens = torch.randint(0, config.vocab_size, (batch, length))
        return Case("example-llama", llama.Llama(config), (tokens,))

    def qwen() -> Case:
        qwen = _example("qwen")

        config = qwen.QwenConfig() if FULL else qwen.QwenConfig(
            vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, n_experts=2, top_k=2,
            expert_hidden_dim=48, max_seq_len=16)
        batch, length = (4, 32) if FULL else (2, 16)
        tokens = torch.randint(0, config.vocab_size, (batch, length))
        return Case("example-qwen", qwen.Qwen(config), (tokens,))

    return {f"example-{f.__name__}": f for f in (mlp, resnet, unet, densenet, dlrm, mingpt, llama, qwen)}


def build_case(name: str) -> Case:
    """The case called ``name`` (``example-resnet``, ``dense-4``...), built the same way in any process."""
    examples = _examples()
    if name in examples:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            case = examples[name]()
        case.module.train()
        return case
    kind, seed = name.rsplit("-", 1)
    return random_networks.generate(int(seed), kind)


def case_names() -> list[str]:
    kinds = random_networks.KINDS
    return [*_examples(), *(f"{kinds[seed % len(kinds)]}-{seed}" for seed in _seeds())]


# ----------------------------------------------------------------------------------------------------------
# Running one variant


@dataclasses.dataclass
class Run:
    tensors: dict[str, torch.Tensor]
    """Outputs, gradients and buffers after one forward and backward pass, as float64."""
    kernels: Counter | None = None
    """For compiled runs: host kernel calls and the products/convolutions left to XLA, over the programs
    compiled during the run; None for eager runs."""


def _projection(case_name: str, index: int, shape: torch.Size) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(f"{case_name}/{index}".encode()))
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def _module_text(module: bytes | str) -> str:
    if isinstance(module, str):
        return module
    from jax.extend.mlir import ir

    from tpucompile.runtime.mlir_walk import context

    with context():
        return str(ir.Module.parse(module))


@contextlib.contextmanager
def counting_kernels() -> Iterator[Counter]:
    """Counts, in every program compiled for this process's CPU inside the block, the host kernel calls and
    the dots and convolutions left to XLA (``runtime.compiler.for_target`` is where the rewrite happens)."""
    from tpucompile.runtime import compiler

    counts: Counter = Counter()
    original = compiler.for_target

    def recording(*args, **kwargs):
        module = original(*args, **kwargs)
        text = _module_text(module)
        counts["programs"] += 1
        counts[HOST_GEMM] += text.count(f"@{HOST_GEMM}(")
        counts[HOST_CONV] += text.count(f"@{HOST_CONV}(")
        counts["xla dot_general"] += len(re.findall(r"stablehlo\.dot_general\b", text))
        counts["xla convolution"] += len(re.findall(r"stablehlo\.convolution\b", text))
        return module

    compiler.for_target = recording
    try:
        yield counts
    finally:
        compiler.for_target = original


@contextlib.contextmanager
def _without_onednn() -> Iterator[None]:
    """ATen's own convolutions instead of oneDNN's (``torch.backends.mkldnn.flags`` without its TF32 warning)."""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


def run_variant(case: Case, variant: str) -> Run:
    """``case`` run as ``variant``: "eager64", "eager", "on" or "off" (compiled with those ``host_kernels``)."""
    from tpucompile import driver

    torch._dynamo.reset()
    module = copy.deepcopy(case.module)
    dtype = torch.float64 if variant == "eager64" else None
    if dtype is not None:
        module = module.to(dtype)
    leaves, args = case.arguments(dtype)
    counts: Counter | None = None
    with contextlib.ExitStack() as stack:
        if variant.startswith("eager"):
            function = module
            # oneDNN's 1x1 strided weight gradient of channels-last inputs with few channels writes out of bounds
            # in torch 2.13 (uxlfoundation/oneDNN#6035: heap corruption, later segfaults); the reference takes
            # ATen's own convolutions.
            stack.enter_context(_without_onednn())
        else:
            function = torch.compile(module, backend="tpucompile", fullgraph=True,
                                     options={"cache_mode": "off", "host_kernels": variant})
            counts = stack.enter_context(counting_kernels())
        before = driver.graphs_compiled()
        outputs = function(*args)
        outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        outputs = [o for o in outputs if isinstance(o, torch.Tensor) and o.is_floating_point()]
        loss = sum((o * _projection(case.name, i, o.shape).to(o.dtype)).sum() for i, o in enumerate(outputs))
        loss.backward()
        if counts is not None:
            assert driver.graphs_compiled() >= before + 2, f"{case.name}: tpucompile compiled no forward+backward"
    torch._dynamo.reset()
    tensors = {f"output {i}": o.detach() for i, o in enumerate(outputs)}
    for i, leaf in enumerate(leaves):
        if leaf.is_floating_point():
            tensors[f"grad input {i}"] = leaf.grad
    for name, parameter in module.named_parameters():
        tensors[f"grad {name}"] = parameter.grad
    for name, buffer in module.named_buffers():
        if buffer is not None and buffer.is_floating_point():
            tensors[f"buffer {name}"] = buffer.detach()
    return Run({k: None if v is None else v.to(torch.float64).clone() for k, v in tensors.items()}, counts)


# ----------------------------------------------------------------------------------------------------------
# Comparing


def _worst(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, str]:
    """Largest |actual - expected| (inf where finiteness differs) and a description of where it is."""
    difference = (actual - expected).abs()
    both_nan = actual.isnan() & expected.isnan()
    difference = torch.where(both_nan, torch.zeros_like(difference), difference)
    difference = torch.where(difference.isnan(), torch.full_like(difference, float("inf")), difference)
    if difference.numel() == 0:
        return 0.0, ""
    flat = int(difference.argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), difference.shape))
    return float(difference.max()), f"at {index}: {actual.flatten()[flat]:.6g} vs {expected.flatten()[flat]:.6g}"


def compare(case: Case, runs: dict[str, Run]) -> list[str]:
    """Every violation of the tolerance rule (see the module docstring), one line each."""
    problems = []
    reference = runs["eager"].tensors
    magnitudes = [float(t.abs().max()) for t in runs["eager64"].tensors.values() if t is not None and t.numel()]
    case_scale = CASE_SCALE * float(torch.tensor(magnitudes).median()) if magnitudes else 0.0
    for variant in ("eager64", "off", "on"):
        missing = set(reference) ^ set(runs[variant].tensors)
        if missing:
            problems.append(f"{variant} run has other tensors than eager: {sorted(missing)}")
    for name in sorted(reference):
        values = {v: r.tensors.get(name) for v, r in runs.items()}
        if any(v is None for v in values.values()):
            if any(v is not None for v in values.values()):
                present = sorted(k for k, v in values.items() if v is not None)
                problems.append(f"{name}: only {present} have it (a gradient missing?)")
            continue
        shapes = {v: tuple(t.shape) for v, t in values.items()}
        if len(set(shapes.values())) > 1:
            problems.append(f"{name}: shapes differ {shapes}")
            continue
        eager64, eager, off, on = (values[v] for v in ("eager64", "eager", "off", "on"))
        scale = max(float(eager64.abs().max()) if eager64.numel() else 0.0, case_scale)
        floor = FLOOR * scale
        xla_noise, _ = _worst(eager, off)
        eager_noise, _ = _worst(eager, eager64)
        tol = max(MARGIN * xla_noise, floor)
        tol_ref = max(MARGIN * eager_noise, floor)
        checks = [
            ("on", "off", on, off, tol, f"max({MARGIN:g} x max|eager - off| {xla_noise:.3g}, floor {floor:.3g})"),
            ("on", "eager", on, eager, tol, f"max({MARGIN:g} x max|eager - off| {xla_noise:.3g}, floor {floor:.3g})"),
            ("off", "eager", off, eager, tol_ref,
             f"max({MARGIN:g} x max|eager - eager64| {eager_noise:.3g}, floor {floor:.3g})"),
        ]
        for a, b, actual, expected, bound, parts in checks:
            error, where = _worst(actual, expected)
            if not error <= bound:
                problems.append(f"{name} {tuple(actual.shape)}: max |{a} - {b}| = {error:.3g} > tol {bound:.3g} "
                                f"= {parts} (ratio {error / bound if bound else float('inf'):.3g}); "
                                f"worst {where}; scale {scale:.3g}")
    on_kernels, off_kernels = runs["on"].kernels, runs["off"].kernels
    if on_kernels is not None and on_kernels[HOST_GEMM] + on_kernels[HOST_CONV] == 0:
        problems.append(f"host_kernels='on' compiled no program calling a host kernel ({dict(on_kernels)}; an "
                        f"executable reused from 'off'?): the comparison proves nothing")
    if off_kernels is not None and off_kernels[HOST_GEMM] + off_kernels[HOST_CONV]:
        problems.append(f"host_kernels='off' still calls host kernels ({dict(off_kernels)})")
    return problems


def _kernel_summary(counts: Counter | None) -> str:
    if counts is None:
        return "kernel use unknown"
    return (f"{counts[HOST_GEMM]} products and {counts[HOST_CONV]} convolutions on host kernels, "
            f"{counts['xla dot_general']} products and {counts['xla convolution']} convolutions left to XLA, "
            f"in {counts['programs']} programs")


# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", case_names())
def test_host_kernels_match_xla(name):
    from tpucompile.runtime.host_kernels.library import kernels

    if kernels() is None:
        pytest.skip("no host kernels in this process (TPUCOMPILE_HOST_BLAS=0, or no C compiler or BLAS)")
    case = build_case(name)
    runs = {variant: run_variant(case, variant) for variant in ("eager64", "eager", "off", "on")}
    problems = compare(case, runs)
    summary = _kernel_summary(runs["on"].kernels)
    print(f"{case.name}: host_kernels='on': {summary}")
    assert not problems, (f"{case.name} ({case.description or 'example model'}); host_kernels='on': {summary}\n  "
                          + "\n  ".join(problems))
