#!/usr/bin/env bash
# The GPU checks still open (#18: predictions against a calibrated file, full recompute's and
# the launches' host prices; #20: MFU, the offloaded optimizer on a GPU, the gradient hooks'
# host time, NCCL's waits on the stream), as one command for a lent one-GPU machine: ~8 minutes, each step under its own
# timeout so that one that hangs leaves the others' results.
#
# On a development machine (registry reachable), once: the wheels the GPU image lacks (it holds
# torch, networkx, sympy, rich, matplotlib, pyyaml, transformers and safetensors; not pulp and
# highspy), for its Python 3.12, in the ignored .whl/:
#
#   benchmarks/gpu_session.sh --fetch-wheels
#
# Then, through the device tool (`run`, carry [".whl"], timeout_s 600):
#
#   OUT=$OUT bash benchmarks/gpu_session.sh
#
# What comes back under $OUT (at most 8 files): calibrated.json (`autopar calibrate --device
# cuda`), step.json (MFU, autopar against eager and compiled eager, predicted by the preset and
# the calibrated file, a host profile), recompute.json, offload.json, memory.json (predicted
# against torch.cuda.max_memory_allocated), nccl-wait.json (the host's wait on a NCCL collective
# with a timeout against autopar's stream wait), session.log. `--dry-run` prints the steps and checks
# that every script takes the options given (on any machine).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--fetch-wheels" ]; then
    exec python3 -m pip download --dest .whl --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --no-deps \
        "pulp>=3.3.1,<4" "highspy>=1.7"
fi

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
PY=${PYTHON:-python3}
OUT=${OUT:-out}
mkdir -p "$OUT"
LOG="$OUT/session.log"
export PYTHONUNBUFFERED=1
CAL="$OUT/calibrated.json"

# seconds, then the command; the step's output goes to the log and to the terminal
STEPS=(
    "90 $PY -m autopar calibrate --device cuda --out $CAL"
    "30 $PY benchmarks/nccl_wait.py --json $OUT/nccl-wait.json"
    "200 $PY benchmarks/gpu_step.py --steps 10 --rounds 3 --compile autopar --host-profile 3 --cluster $CAL --json $OUT/step.json"
    "90 $PY benchmarks/gpu_step.py --steps 3 --rounds 2 --recompute full --cluster $CAL --json $OUT/recompute.json"
    "60 $PY benchmarks/gpu_step.py --steps 2 --rounds 1 --offload optimizer --fused --host-profile 1 --cluster $CAL --json $OUT/offload.json"
    "130 $PY benchmarks/gpu_memory.py --cluster $CAL --json $OUT/memory.json"
)

if [ $DRY = 1 ]; then
    status=0
    for s in "${STEPS[@]}"; do
        cmd=${s#* }
        echo "would run (timeout ${s%% *} s): $cmd"
        # every option the step passes must be one its script declares
        script=$(echo "$cmd" | awk '{for (i = 1; i <= NF; i++) if ($i ~ /\.py$/) print $i}')
        if [ -n "$script" ]; then
            for opt in $(echo "$cmd" | grep -o -- '--[a-z-]*'); do
                grep -q -- "\"$opt\"" "$script" || { echo "  $script has no option $opt"; status=1; }
            done
        fi
    done
    exit $status
fi

{
    echo "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1)"
    if [ -d .whl ]; then
        $PY -m pip install -q --no-index --find-links .whl pulp highspy
    fi
    $PY -m pip install -q -e . --no-deps --no-build-isolation
    $PY -c "import torch, autopar; print('torch', torch.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee -a "$LOG"

for s in "${STEPS[@]}"; do
    limit=${s%% *}
    cmd=${s#* }
    echo "== $(date -u +%T) (timeout $limit s) $cmd" | tee -a "$LOG"
    timeout "$limit" $cmd 2>&1 | tee -a "$LOG"
    echo "== exit ${PIPESTATUS[0]}" | tee -a "$LOG"
done
