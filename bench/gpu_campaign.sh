#!/usr/bin/env bash
# Every check that needs a GPU, in one run on a machine with CUDA: the GPU test suite
# (plain and under PyTorch's CUDA sanitizer), the GPU benchmarks and the demo on the GPU
# plus CPU workers. Each step has its own time limit, so a hang costs one step, not the run;
# logs and JSON land in $OUT (default ./gpu-out), one line per step in $OUT/summary.txt.
#
#   bash bench/gpu_campaign.sh [STEP ...]     # steps: env tests sanitizer gpubench demo hetero heterps pushpull shard
#
# On a machine without pydantic, wheels in .whl/ are installed first (no network needed).
#
# The step limits add up to more than one device command may run (600 s) and than a
# session's device time (900 s): run the bars first, in one command,
#   bash bench/gpu_campaign.sh env hetero pushpull shard     # limits 480 s
# then what time is left allows: tests (300 s), sanitizer (210 s), demo, gpubench, heterps.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(env tests sanitizer gpubench demo hetero pushpull shard heterps)

step() {  # step NAME LIMIT_S LOGFILE CMD...
    local name=$1 lim=$2 logf=$3; shift 3
    local t0; t0=$(date +%s)
    echo "=== $name (limit ${lim}s) $(date +%T): $*" | tee -a "$logf"
    timeout -k 15 "$lim" "$@" >>"$logf" 2>&1
    local rc=$?
    local line="$name rc=$rc $(( $(date +%s) - t0 ))s"
    echo "=== $line" | tee -a "$logf"
    echo "$line" >>"$OUT/summary.txt"
}

if ! "$PY" -c "import pydantic" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile .whl/*.whl >>"$OUT/summary.txt" 2>&1 \
        || echo "could not install .whl/ into $PY's environment" >>"$OUT/summary.txt"
fi

for s in "${steps[@]}"; do
    case "$s" in
    env)
        { date; nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv; nproc
          "$PY" -c "import torch, pydantic; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'avail', torch.cuda.is_available(), 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None,
'pydantic', pydantic.VERSION)"; } >>"$OUT/summary.txt" 2>&1 ;;
    tests)  # launched tests are independent jobs on the one GPU (gloo between them): run 4 at once
        step tests 300 "$OUT/tests.log" "$PY" -m pytest -q -m gpu -n 4 --timeout 200 -p no:cacheprovider \
            --junitxml "$OUT/junit.xml" tests ;;
    sanitizer)  # torch's CUDA sanitizer: the in-process CUDA paths, then overlapped launched jobs
        step sanitizer_inproc 60 "$OUT/sanitizer.log" "$PY" -m pytest -q -m gpu --cuda-sanitizer --tb=short \
            -p no:cacheprovider tests/gpu tests/heterps/test_gpu.py -k "not training_matches and not codecs_encode \
            and not ddp_comm and not staleness and not stages_equal and not too_small and not several_exchanges \
            and not balanced_give"
        step sanitizer_launched 150 "$OUT/sanitizer.log" "$PY" -m pytest -q -m gpu --cuda-sanitizer -n 3 \
            --tb=short -p no:cacheprovider tests/gpu -k "byteps-True or allreduce-True or codecs_encode \
            or several_exchanges or unequal-0.3" ;;
    gpubench)
        step gpubench 150 "$OUT/bench.log" "$PY" bench/gpu.py --quick --json "$OUT/gpu.json" ;;
    demo)
        step demo 90 "$OUT/bench.log" "$PY" -m hetrain.cli demo --quiet --run-dir /tmp/hetrain-demo ;;
    hetero)
        step hetero_real 240 "$OUT/bench.log" "$PY" bench/hetero_real.py --quick --json "$OUT/hetero_real.json" \
            --png /tmp/hetero_real_shares.png ;;
    heterps)
        step heterps_real 150 "$OUT/bench.log" "$PY" bench/heterps.py --real --quick --json "$OUT/heterps_real.json" ;;
    pushpull)  # push_pull of 100M parameters from CUDA against the pinned copies of the same run
        step cuda_push_pull 120 "$OUT/bench.log" "$PY" bench/cuda_push_pull.py --json "$OUT/cuda_push_pull.json" ;;
    shard)  # a GPU capped below the model's replica size, training beside CPU workers
        step shard_gpu 120 "$OUT/bench.log" "$PY" bench/shard.py --gpu --quick --json "$OUT/shard_gpu.json" ;;
    *) echo "unknown step $s" >>"$OUT/summary.txt" ;;
    esac
done
cat "$OUT/summary.txt"
