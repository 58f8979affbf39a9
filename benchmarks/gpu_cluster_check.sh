#!/usr/bin/env bash
# The cluster checks on a GPU machine, in under 5 minutes:
#   1. benchmarks/stress_bench.py: a plain torch.matmul loop vs stress-gpu on GPU 0, 20 s each (bf16 8192²);
#      the aim is a ratio >= 0.90, i.e. checking every result costs the measured TFLOPS nothing
#   2. smolctl stress-gpu for 60 s on every GPU (the final OK/FAULTY table)
#   3. smolctl benchmark-nccl over every GPU (NCCL needs 2+ GPUs; with one, a 2-process gloo smoke run instead)
#
#   bash benchmarks/gpu_cluster_check.sh            # logs in $OUT (default benchmarks/out/)
#
# Needs a CUDA build of torch; smolctl runs from this checkout (PYTHONPATH), installed or not.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}  # a Python with a CUDA build of torch
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0

nvidia-smi --query-gpu=index,name,memory.total,driver_version,power.limit --format=csv | tee "$OUT/gpus.csv"
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
"$PY" -c "import pynvml" 2>/dev/null && echo "nvidia-ml-py: present (telemetry on)" || echo "nvidia-ml-py: absent (no telemetry)"

echo "== 1. plain matmul loop vs stress-gpu (GPU 0, 20 s each)"
COLUMNS=140 timeout 120 "$PY" benchmarks/stress_bench.py --seconds 20 2>&1 | tee "$OUT/stress_bench.txt" || status=1

echo "== 2. stress-gpu --duration 60 on all $NGPU GPU(s)"
COLUMNS=140 timeout 150 "$PY" -m smolctl stress-gpu --duration 60 2>&1 | tee "$OUT/stress_gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

if [ "$NGPU" -ge 2 ]; then
    echo "== 3. benchmark-nccl over $NGPU GPUs (NCCL)"
    COLUMNS=140 timeout 240 "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
        -m smolctl benchmark-nccl --max-bytes 8G --iters 20 --warmup 5 2>&1 | tee "$OUT/benchmark_nccl.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
    echo "== 3. benchmark-nccl: 1 GPU, and NCCL puts at most one rank on a GPU; 2-process gloo smoke run instead"
    COLUMNS=140 timeout 120 "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 \
        -m smolctl benchmark-nccl --backend gloo --max-bytes 64M --iters 5 --warmup 2 2>&1 | tee "$OUT/benchmark_nccl.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
echo "gpu_cluster_check: exit $status (logs in $OUT/)"
exit $status
