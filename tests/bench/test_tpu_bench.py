"""The TPU benchmark's tools (``bench/tpu.py``, ``bench/hlo_bytes.py``) on programs compiled for a v5e chip
here, and a regression guard on what a small bf16 GPT training step costs there: the bytes its forward saves
for its backward and each program's peak memory, against the figures measured when the guard was set (slack
for libtpu's version drift, not for regressions). Needs libtpu (the ``tpu`` extra)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason='libtpu is not installed (pip install "tpucompile[tpu]")')
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))

TARGET = "tpu:v5e:1x1"


@pytest.fixture(scope="module")
def small_gpt_training():
    """The small GPT's training programs for the target with attention in its math form (the guard's
    original figures), the JAX reference's, and the programs on the default route (the splash kernel)."""
    import tpu
    import tpu_workloads

    from tpucompile.runtime.targets.compile_only import compile_only_target

    workload = tpu_workloads.build("gpt", torch.bfloat16, small=True)
    programs, activations, weights = tpu.ours(workload, "training", TARGET, {"attention": "math"})
    reference = tpu.reference(workload, "training", compile_only_target(TARGET).devices[0])
    kernel_route = tpu.ours(tpu_workloads.build("gpt", torch.bfloat16, small=True), "training", TARGET)
    return programs, activations, weights, reference, kernel_route


def test_breakdown_accounts_for_the_program_and_names_its_ops(small_gpt_training):
    import hlo_bytes

    programs, _, _, reference, (kernel_programs, _, _) = small_gpt_training
    for program in [*programs, reference, *kernel_programs]:
        rows = hlo_bytes.entry_traffic(program.hlo)
        assert rows and rows == sorted(rows, key=lambda r: r.total, reverse=True)
        total = sum(r.total for r in rows)
        # Top-level reads and writes bound XLA's count from above (it refines some kinds down), within reason.
        assert 0.5 * program.bytes_accessed <= total <= 3 * program.bytes_accessed, (program.role, total)
        assert any(r.cycles > 0 for r in rows) and program.cycles == sum(r.cycles for r in rows)
    ops = {r.op_name for r in hlo_bytes.entry_traffic(programs[0].hlo)}
    assert any(op.startswith("aten.") for op in ops), sorted(ops)[:10]
    table = hlo_bytes.table(hlo_bytes.entry_traffic(programs[1].hlo), top=5)
    assert table.count("\n") == 1 + 5 + 1 and "| all " in table


def test_small_gpt_training_step_costs_what_it_was_measured_at(small_gpt_training):
    """With attention in its math form, measured at 2 x 128 tokens, width 256, 2 blocks, bf16 (jax 0.10.2,
    libtpu 0.0.42): the forward saves
    7,115,778 bytes of activations (and passes 5,249,536 bytes of weights); the programs' peaks are 18.8 MB and
    23.4 MB (the backward's 24.4 MB before it took over saved values: 1,310,720 bytes aliased), the hand-written
    JAX step's 25.7 MB; the two programs access 188.5 MB (80.1 + 108.4), the JAX step 100.7 MB (ours is two
    programs at a size where each program's fixed traffic counts). XLA counts 4.28 GFLOP against the
    reference's 4.33: the forward's products written narrow (the "auto" default) count 1.404 GFLOP where
    f32 products and converts count 1.441, the backward 2.878 either way; never more than 1% above."""
    programs, activations, weights, reference, _ = small_gpt_training
    assert [p.role for p in programs] == ["forward", "backward"]
    assert activations <= 1.10 * 7_115_778, activations
    assert weights == 5_249_536
    assert programs[0].memory["peak"] <= 1.10 * 18_774_528
    assert programs[1].memory["peak"] <= 1.03 * 23_353_856
    assert programs[1].memory["alias"] >= 1_310_720, "the backward no longer takes over saved values"
    assert sum(p.bytes_accessed for p in programs) <= 1.10 * 188_508_672
    assert max(p.memory["peak"] for p in programs) <= 1.10 * reference.memory["peak"]
    assert 0.98 * reference.flops <= sum(p.flops for p in programs) <= 1.01 * reference.flops


def test_small_gpt_training_step_on_the_kernel_route_costs_what_it_was_measured_at(small_gpt_training):
    """The default route for a TPU, attention (head size 64) through the splash kernel, measured the same way:
    one kernel call per block forward and two backward; the forward saves 6,829,058 bytes of activations;
    peaks 17.7 MB and 25.4 MB (the backward's 2.0 MB above the math form's, where the math form's forward
    peak is 1.0 MB above); 179.7 MB accessed. XLA counts neither the kernel's flops nor its cycles."""
    math_programs, math_activations, _, _, (programs, activations, weights) = small_gpt_training
    assert [p.kernels for p in programs] == [2, 4]
    assert activations <= 1.10 * 6_829_058 and activations < math_activations, activations
    assert weights == 5_249_536
    assert programs[0].memory["peak"] <= 1.10 * 17_747_968
    assert programs[1].memory["peak"] <= 1.03 * 25_378_304
    assert sum(p.bytes_accessed for p in programs) <= 1.10 * 179_652_608
    assert sum(p.bytes_accessed for p in programs) < sum(p.bytes_accessed for p in math_programs)


def test_a_loop_s_body_counts_once_per_iteration():
    """A rolled loop's body instructions appear with their bytes and cycles times the trip count its
    ``op_name`` carries; a kernel's multi-line metadata inside the entry does not end it."""
    import hlo_bytes

    text = """HloModule m

%body.1 (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %f = f32[8] fusion(f32[8] %x), kind=kLoop, calls=%c, backend_config={"estimated_cycles":"7"}
  ROOT %t = (s32[], f32[8]) tuple(%p, %f)
}

ENTRY %main.2 (a: f32[8]) -> f32[8] {
  %k = f32[8] custom-call(f32[8] %a), custom_call_target="tpu_custom_call", backend_config={"meta":{"a": 1
}, "estimated_cycles":"100"}
  %w = (s32[], f32[8]) while((s32[], f32[8]) %t0), condition=%c, body=%body.1, metadata={op_name="rolled loop x16"}
  ROOT %g = f32[8] fusion(f32[8] %k), kind=kLoop, calls=%y, backend_config={"estimated_cycles":"50"}
}
"""
    rows = {row.name: row for row in hlo_bytes.entry_traffic(text)}
    assert set(rows) == {"k", "g", "f x16"}, rows
    assert rows["f x16"].cycles == 16 * 7 and rows["f x16"].read == 16 * 32 and rows["g"].cycles == 50
