#!/usr/bin/env bash
# The cluster checks on a GPU machine, in under 5 minutes (one GPU: about 3.5):
#   1. benchmarks/stress_bench.py: a plain torch.matmul loop vs stress-gpu on GPU 0, 20 s each (bf16 8192²);
#      the aim is a ratio >= 0.90, i.e. checking every result costs the measured TFLOPS nothing; then stress-gpu
#      on every GPU in processes vs threads (its launch choice: threads share one GIL for all launches)
#   2. smolctl stress-gpu for 60 s on every GPU (the OK/FAULTY table, NVML telemetry, --expect-gpus from nvidia-smi)
#   3. smolctl stress-gpu --devices all with CUDA_VISIBLE_DEVICES="" must fail (exit 1): a node whose GPUs torch
#      cannot see never passes
#   4. smolctl benchmark-nccl over every GPU (NCCL needs 2+ GPUs; with one, a 2-process gloo run instead)
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

nvidia-smi --query-gpu=index,name,memory.total,driver_version,power.limit,pcie.link.gen.max,pcie.link.width.max \
    --format=csv | tee "$OUT/gpus.csv"
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
"$PY" -c "import pynvml; pynvml.nvmlInit(); print('NVML driver', pynvml.nvmlSystemGetDriverVersion())" \
    || echo "nvidia-ml-py / NVML: not usable (stress-gpu will say its telemetry is missing)"

echo "== 1. plain matmul loop vs stress-gpu (GPU 0, 20 s each), then processes vs threads on all $NGPU GPU(s)"
COLUMNS=140 timeout 150 "$PY" benchmarks/stress_bench.py --seconds 20 --all-gpus 2>&1 | tee "$OUT/stress_bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== 2. stress-gpu --duration 60 on all $NGPU GPU(s)"
COLUMNS=140 timeout 120 "$PY" -m smolctl stress-gpu --duration 60 2>&1 | tee "$OUT/stress_gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== 3. stress-gpu with no GPU visible must fail"
CUDA_VISIBLE_DEVICES="" COLUMNS=140 timeout 60 "$PY" -m smolctl stress-gpu --duration 5 2>&1 | tee "$OUT/stress_no_gpu.txt"
[ "${PIPESTATUS[0]}" -eq 1 ] || { echo "expected exit 1"; status=1; }

if [ "$NGPU" -ge 2 ]; then
    echo "== 4. benchmark-nccl over $NGPU GPUs (NCCL)"
    COLUMNS=140 timeout 240 "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
        -m smolctl benchmark-nccl --max-bytes 8G --iters 20 --warmup 5 2>&1 | tee "$OUT/benchmark_nccl.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
    echo "== 4. benchmark-nccl: 1 GPU, and NCCL puts at most one rank on a GPU; 2-process gloo run instead"
    COLUMNS=140 timeout 120 "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 \
        -m smolctl benchmark-nccl --backend gloo --max-bytes 64M --iters 5 --warmup 2 2>&1 | tee "$OUT/benchmark_nccl.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
echo "gpu_cluster_check: exit $status (logs in $OUT/)"
exit $status
