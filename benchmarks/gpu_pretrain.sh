#!/usr/bin/env bash
# Tokens/s, MFU and peak memory of `smolctl pretrain` for the SmolLM3-3B architecture (128k vocabulary) at seq 4096
# in bf16 with the chunked loss, against the dry run's memory estimate. About 5 minutes on one H100/H200.
#   bash benchmarks/gpu_pretrain.sh [OUT]          (needs a CUDA GPU; the aim is MFU >= 45%)
# Variants: eager; torch.compile per decoder layer; compile + selective checkpointing at a larger micro batch;
# and, with 2+ GPUs, FSDP2 (bf16 parameters, fp32 reductions) under torchrun. The sample corpus is packed at seq
# 4096 with a small local tokenizer; model.vocab_size = 128256 keeps the real LM head, so the compute is the 3B
# model's. The dry run sizes each variant with `smolctl estimate`'s memory model for comparison. A metrics line
# every 4 steps: the loop syncs with the GPU once per logging interval, as in a long run.
set -euo pipefail
OUT=${1:-gpu-bench}
PY=${PYTHON:-.venv/bin/python}
STEPS=${STEPS:-16}
GPU=${GPU:-h200}
mkdir -p "$OUT"
GPUS=$("$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.cuda.device_count())")

[ -d "$OUT/tok" ] || "$PY" -m smolctl train-tokenizer data/sample/web "$OUT/tok" --vocab-size 4096 --json > /dev/null
[ -d "$OUT/packed" ] || "$PY" -m smolctl pack data/sample/web "$OUT/packed" --tokenizer "$OUT/tok" --seq-len 4096 --json > /dev/null

COMMON=(--data "$OUT/packed" --set model.tokenizer="\"$OUT/tok\"" --set training.steps="$STEPS" --set parallel.tp=1
        --set schedule.warmup_steps=2 --set schedule.decay_steps=2 --set checkpoint.interval=0 --set logging.interval=4)
run() {  # NAME PROCESSES, then --set overrides
  local name=$1 procs=$2; shift 2
  local launch=("$PY" -m smolctl)
  [ "$procs" -gt 1 ] && launch=("$PY" -m torch.distributed.run --nproc_per_node "$procs" -m smolctl)
  "${launch[@]}" pretrain recipes/smollm3.toml "$OUT/$name" --overwrite --json "${COMMON[@]}" "$@" > "$OUT/$name.json"
  "$PY" -m smolctl pretrain recipes/smollm3.toml --dry-run --world-size "$procs" --gpu "$GPU" --json "${COMMON[@]}" "$@" \
    > "$OUT/$name.dry.json"
}
run eager 1 --set training.micro_batch=2 --set training.global_batch_tokens=16384 --set training.shard=false
run compiled 1 --set training.micro_batch=2 --set training.global_batch_tokens=16384 --set training.shard=false --set training.compile=true
run compiled-selective 1 --set training.micro_batch=4 --set training.global_batch_tokens=16384 --set training.shard=false \
    --set training.compile=true --set training.activation_checkpointing='"selective"'
if [ "$GPUS" -ge 2 ]; then
  run fsdp2-compiled 2 --set training.micro_batch=2 --set training.global_batch_tokens=16384 --set training.shard=true --set training.compile=true
fi

"$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'variant':<20} {'tokens/s/GPU':>12} {'MFU':>7} {'step s':>7} {'peak GiB':>9} {'dry run GiB':>12}  (steady state: steps after the 4th)")
for result in sorted(out.glob("*.dry.json")):
    name = result.name.removesuffix(".dry.json")
    run, dry = json.loads((out / f"{name}.json").read_text()), json.loads(result.read_text())
    lines = [json.loads(l) for l in (out / name / "metrics.jsonl").read_text().splitlines() if '"loss"' in l][1:]  # a line per 4 steps
    step_s = sum(l["step_s"] for l in lines) / len(lines)
    per_gpu = run["plan"]["tokens_per_step"] / step_s / run["plan"]["world_size"]
    mfu = sum(l["mfu"] or 0 for l in lines) / len(lines)
    print(f"{name:<20} {per_gpu:>12,.0f} {mfu:>7.1%} {step_s:>7.2f} {run['peak_memory'] / 2**30:>9.2f} "
          f"{dry['memory']['allocated'] / 2**30:>12.2f}")
PYEOF
