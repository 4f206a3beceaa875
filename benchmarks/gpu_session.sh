#!/usr/bin/env bash
# One prepared run for a session that has a GPU (the device tool's `run`): the CUDA tests, then
# the GPU benchmarks, each phase under its own time limit and all of them under one deadline,
# from the repository root:
#   bash benchmarks/gpu_session.sh [SECONDS=540]
# $OUT (default ./gpu-session-out) gets three files: session.log (each phase's exit status and
# seconds, then the tails of the logs), tests.log (pytest -v: a line per test, so a run cut by
# its limit still says what passed) and results.tgz (every phase's results directory and log,
# re-packed after each phase). Unpack results.tgz into benchmarks/results/ (its folders are
# named cuda-*). GS_SESSION_DEVICE=cpu with GS_SESSION_TINY=1 is the dry run on a machine
# without a GPU: the same commands at tiny sizes. Nothing here installs anything: the device
# image has torch, transformers, pytest, pytest-xdist and pytest-timeout.
set -uo pipefail
out="${OUT:-gpu-session-out}"
deadline=$((SECONDS + ${1:-540}))
dev="${GS_SESSION_DEVICE:-cuda}"
tiny="${GS_SESSION_TINY:-0}"
work="$(mktemp -d)"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
py=python3
command -v "$py" > /dev/null || py=python

# phase NAME LIMIT COMMAND...: runs COMMAND under min(LIMIT, time left before the deadline less
# 10 s for packing), its output in $work/NAME.log; the exit status and seconds in session.log.
phase() {
    local name="$1" limit="$2"
    shift 2
    local left=$((deadline - SECONDS - 10))
    ((left < limit)) && limit=$left
    if ((limit < 15)); then
        echo "$name: skipped, $left s left" >> "$out/session.log"
        return
    fi
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" > "$work/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - t0)) s (limit $limit s)" >> "$out/session.log"
    tar czf "$out/results.tgz" -C "$work" .
}

{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2> /dev/null || echo "no nvidia-smi"
    "$py" -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'cpus', __import__('os').cpu_count())"
} > "$out/session.log" 2>&1

# 1. The CUDA half of the suite (the device-parametrised tests and the CUDA-only ones), on the
# CUDA default path (the steady state), 8 workers.
timeout_opt=()
"$py" -c "import pytest_timeout" 2> /dev/null && timeout_opt=(--timeout 120)
sel="cuda"
((tiny)) && sel="cuda and test_saved_tensors"
t0=$SECONDS
timeout -k 5 $((tiny ? 120 : 190)) "$py" -m pytest -v -p no:cacheprovider -n 8 -k "$sel" "${timeout_opt[@]}" \
    -rfEs --tb=short tests > "$out/tests.log" 2>&1
echo "tests: exit $? after $((SECONDS - t0)) s" >> "$out/session.log"

# 2. Real sizes: step time and memory against checkpoint (bf16 Llama and Mixtral).
if ((tiny)); then sizes=(--size tiny --rounds 1 --models llama); else sizes=(--rounds 3 --models llama mixtral); fi
phase cuda-models 120 "$py" -m benchmarks.models --device "$dev" --gpu-suite "${sizes[@]}" --no-charts \
    --strategies plain checkpoint scope_layer scope_layer+recorded budget50 plain_again \
    --phase-timeout 50 --out "$work/cuda-models"

# 3. Where users train: 30 padded lengths, and the KV cache on (16-layer Llama, host size).
if ((tiny)); then runs=(--lengths 3 --steps 6 --layers 2 --rounds 1); else runs=(--steps 60 --layers 16 --rounds 1); fi
if ((tiny)); then cache=(--steps 6 --layers 2 --rounds 1); else cache=("${runs[@]}"); fi
phase cuda-host-lengths30 90 "$py" -m benchmarks.host_cost --device "$dev" "${runs[@]}" --lengths $((tiny ? 3 : 30)) \
    --out "$work/cuda-host-lengths30"
phase cuda-host-lengths1-cache 90 "$py" -m benchmarks.host_cost --device "$dev" "${cache[@]}" --cache \
    --out "$work/cuda-host-lengths1-cache"

# 4. Host cost per layer at one length, bf16 (what the forward adds over plain, per layer).
if ((tiny)); then fixed=(--quick --models llama); else fixed=(--rounds 6 --inner 4); fi
phase cuda-host-bf16 80 "$py" -m benchmarks.host_cost --device "$dev" --dtype bfloat16 "${fixed[@]}" \
    --out "$work/cuda-host-bf16"

# 5. Budgets with offload (the budget's rows against save_on_cpu and offload_all), and the
# budget's predicted step against the measured one.
if ((tiny)); then bud=(--rounds 1 --points 1 --models gpt); else bud=(--rounds 3 --models gpt llama); fi
phase cuda-budget 90 "$py" -m benchmarks.budget --quick --device "$dev" --offload --no-charts "${bud[@]}" \
    --out "$work/cuda-budget"

tar czf "$out/results.tgz" -C "$work" .
{
    echo "--- tests.log tail"
    tail -n 40 "$out/tests.log"
    for f in "$work"/*.log; do
        echo "--- $(basename "$f") tail"
        tail -n 25 "$f"
    done
} >> "$out/session.log"
cat "$out/session.log"
