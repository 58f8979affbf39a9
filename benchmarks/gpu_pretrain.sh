#!/usr/bin/env bash
# Tokens/s and MFU of `smolctl pretrain` for SmolLM3-3B (the published architecture, 128k vocabulary) on one GPU,
# eager and with training.compile = true. Under 5 minutes on one H100/H200; prints one table.
#   bash benchmarks/gpu_pretrain.sh [OUT]          (needs a CUDA GPU; the aim is MFU >= 45% in bf16)
# The sample corpus is packed at seq 4096 with a locally trained tokenizer; model.vocab_size = 128256 keeps the
# 3B model's real LM head (the extra embedding rows are simply never seen), so the compute is the real one.
set -euo pipefail
OUT=${1:-gpu-bench}
PY=${PYTHON:-.venv/bin/python}
SMOLCTL=${SMOLCTL:-.venv/bin/smolctl}
STEPS=${STEPS:-16}
mkdir -p "$OUT"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.cuda.get_device_name())"

[ -d "$OUT/tok" ] || "$SMOLCTL" train-tokenizer data/sample/web "$OUT/tok" --vocab-size 4096 --json > /dev/null
[ -d "$OUT/packed" ] || "$SMOLCTL" pack data/sample/web "$OUT/packed" --tokenizer "$OUT/tok" --seq-len 4096 --json > /dev/null

run() {  # NAME, then --set overrides
  local name=$1; shift
  "$SMOLCTL" pretrain recipes/smollm3.toml "$OUT/$name" --data "$OUT/packed" --overwrite --json \
    --set model.tokenizer="\"$OUT/tok\"" --set training.steps="$STEPS" --set training.shard=false \
    --set training.global_batch_tokens=32768 --set schedule.warmup_steps=2 --set schedule.decay_steps=2 \
    --set checkpoint.interval=0 --set logging.interval=1 "$@" > "$OUT/$name.json"
}
run eager --set training.micro_batch=2
run compiled --set training.micro_batch=2 --set training.compile=true
run eager-ckpt --set training.micro_batch=8 --set training.gradient_checkpointing=true

"$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'variant':<12} {'tokens/s':>10} {'MFU':>7} {'step s':>7}  (steady state: steps after the first 5)")
for name in ("eager", "compiled", "eager-ckpt"):
    lines = [json.loads(l) for l in (out / name / "metrics.jsonl").read_text().splitlines()][5:]
    step_s = sum(l["step_s"] for l in lines) / len(lines)
    tokens = 32768 / step_s
    mfu = sum(l["mfu"] or 0 for l in lines) / len(lines)
    print(f"{name:<12} {tokens:>10,.0f} {mfu:>7.1%} {step_s:>7.2f}")
PYEOF
