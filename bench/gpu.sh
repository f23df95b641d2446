#!/usr/bin/env bash
# The benchmark suite on a CUDA GPU, in under 8 minutes: eager vs Inductor vs tpucompile with the models and
# their tensors on the GPU (tpucompile exchanges them with XLA through DLPack, without copies).
#
#   bash bench/gpu.sh            # results under ${OUT:-/tmp/tpucompile-bench-gpu}
#
# Needs torch with CUDA and jax with its CUDA plugin (`pip install "jax[cuda12]"`); the checkout is used as
# is (PYTHONPATH), so no install of tpucompile is needed.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/tpucompile-bench-gpu}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python - <<'PY'
import jax, torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "| jax", jax.__version__, jax.devices())
assert torch.cuda.is_available() and jax.default_backend() == "gpu", "needs a CUDA GPU visible to torch and jax"
PY
timeout 420 python bench/run.py --device cuda --models mlp,gpt,llama,resnet --iters 30 --budget 3 --warmup 5 \
    --out "$OUT/benchmarks-gpu" | tee "$OUT/benchmarks-gpu.log"
