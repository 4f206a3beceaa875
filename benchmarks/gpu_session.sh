#!/usr/bin/env bash
# One prepared run for a session that has a GPU (the device tool's `run`): the CUDA tests,
# then the GPU benchmark, each phase under its own time limit, everything written under
# $OUT (default ./gpu-session-out). Usage, from the repository root:
#   bash benchmarks/gpu_session.sh [TEST_SECONDS=300] [BENCH_SECONDS=330]
# then commit $OUT/cuda-models/ to benchmarks/results/cuda-models/ and $OUT/tests.log's
# summary line to the closing note. Nothing here installs anything: the device image has
# torch, transformers and pytest.
set -uo pipefail
out="${OUT:-gpu-session-out}"
mkdir -p "$out"
tests="${1:-300}"
bench="${2:-330}"
export PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
} > "$out/machine.txt" 2>&1
# 1. the CUDA half of the suite (the device-parametrised tests and the CUDA-only ones)
timeout "$tests" python3 -m pytest -q -p no:cacheprovider -k "cuda" -rs tests > "$out/tests.log" 2>&1
echo "tests exit $?" >> "$out/tests.log"
# 2. the GPU benchmark: every model of the suite, a time limit per model
timeout "$bench" python3 -m benchmarks.models --device cuda --gpu-suite \
    --phase-timeout $((bench / 6)) --out "$out/cuda-models" > "$out/bench.log" 2>&1
echo "benchmark exit $?" >> "$out/bench.log"
tail -n 3 "$out/tests.log" "$out/bench.log"
