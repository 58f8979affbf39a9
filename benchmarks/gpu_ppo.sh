#!/usr/bin/env bash
# Seconds to generate, score and update, and peak GPU memory, per step of `smolctl ppo` with a ~1.7B policy of
# SmolLM3's shape (hidden 2048, 18 layers, GQA 16/4, 128k vocabulary; random weights: the cost is the real one).
#   bash benchmarks/gpu_ppo.sh [OUT]        (needs a CUDA GPU; a few minutes on one H100/H200; prints one table)
# recipes/smollm3-ppo.toml as it is (batch 64, minibatch 16, 3 epochs), except 4 steps and max_new_tokens
# (MAX_NEW, default 512; random weights rarely stop early, so completions run to the limit: the worst case).
set -euo pipefail
OUT=${1:-gpu-ppo-bench}
PY=${PYTHON:-.venv/bin/python}
SMOLCTL=${SMOLCTL:-.venv/bin/smolctl}
STEPS=${STEPS:-4}
MAX_NEW=${MAX_NEW:-512}
mkdir -p "$OUT"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.cuda.get_device_name())"

[ -d "$OUT/tok" ] || "$SMOLCTL" train-tokenizer data/sample/web "$OUT/tok" --vocab-size 4096 --json > /dev/null
[ -d "$OUT/policy" ] || "$PY" - "$OUT" <<'PYEOF'
import sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, SmolLM3Config
from smolctl.data.tokenizer import load_tokenizer
from smolctl.shards import KIND_MODEL, OutputFolder, lineage_ref

out = Path(sys.argv[1])
tokenizer = load_tokenizer(out / "tok")
config = SmolLM3Config(vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=18,
                       num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=8192,
                       tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
model = AutoModelForCausalLM.from_config(config)
print(f"policy: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")
with OutputFolder(out / "policy", kind=KIND_MODEL, inputs=[lineage_ref(out / "tok")]) as folder:
    model.save_pretrained(str(folder.staging))
    tokenizer.save_pretrained(str(folder.staging))
    folder.commit(parent=None)
PYEOF

"$SMOLCTL" ppo recipes/smollm3-ppo.toml "$OUT/run" --from "$OUT/policy" --overwrite --json \
  --set data.path='"data/sample/prompts"' --set data.reference_column='"reference"' \
  --set training.steps="$STEPS" --set ppo.max_new_tokens="$MAX_NEW" --set checkpoint.interval=0 \
  --set logging.interval=1 --set training.gradient_checkpointing=true > "$OUT/run.json"

"$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
lines = [json.loads(l) for l in (Path(sys.argv[1]) / "run" / "metrics.jsonl").read_text().splitlines()]
print(f"{'step':>4} {'generate s':>11} {'score s':>8} {'update s':>9} {'peak GiB':>9} {'tokens':>7}")
for l in lines:
    print(f"{l['step']:>4} {l['seconds/generate']:>11.1f} {l['seconds/score']:>8.1f} {l['seconds/update']:>9.1f} "
          f"{l.get('memory/peak_gib', float('nan')):>9.1f} {l['completion_length'] * 64:>7.0f}")
PYEOF
