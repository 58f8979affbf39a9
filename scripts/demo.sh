#!/usr/bin/env bash
# The whole smolctl pipeline on the shipped sample corpus, on CPU, each stage reading the previous stage's
# output folder. `make demo` runs this. It is also the script to copy onto a cluster login node: swap the sample
# folders for your data and the tiny recipes for recipes/smollm3*.toml, and launch the training stages with
# torchrun or the sbatch files in recipes/slurm/ (see "On a cluster" in the README).
set -euo pipefail
OUT=${1:-demo-out}
DATA=data/sample
rm -rf "$OUT" && mkdir -p "$OUT"
: > "$OUT/stages.tsv"

# stage NAME OUTPUT COMMAND...: run one stage, time it, and note it for the closing table.
stage() {
  local name=$1 output=$2
  shift 2
  printf '\n\033[1m== %s\033[0m  %s\n' "$name" "$*" >&2
  local start=$EPOCHREALTIME
  "$@"
  awk -v n="$name" -v o="$output" -v s="$start" -v e="$EPOCHREALTIME" 'BEGIN { printf "%s\t%s\t%.1f\n", n, o, e - s }' \
    >> "$OUT/stages.tsv"
}

stage train-tokenizer "$OUT/tokenizer" smolctl train-tokenizer "$DATA/web" "$OUT/tokenizer" --vocab-size 4096
for source in web code math; do
  stage "dedup $source" "$OUT/dedup/$source" smolctl dedup "$DATA/$source" "$OUT/dedup/$source" --minhash
done
stage mix "$OUT/mix" smolctl mix "$OUT/mix" --recipe recipes/demo-mix.toml --tokenizer "$OUT/tokenizer" \
  --set sources.web.path="$OUT/dedup/web" --set sources.code.path="$OUT/dedup/code" \
  --set sources.math.path="$OUT/dedup/math"
stage pack "$OUT/packed" smolctl pack "$OUT/mix/stage-1" "$OUT/packed" --tokenizer "$OUT/tokenizer" --seq-len 256
stage "pack (long context)" "$OUT/packed-long" \
  smolctl pack "$OUT/mix/stage-3" "$OUT/packed-long" --tokenizer "$OUT/tokenizer" --seq-len 512
smolctl inspect "$OUT/packed" --samples 1 >/dev/null
stage estimate - smolctl estimate recipes/smollm3-tiny.toml --validate --set "data.paths=['$OUT/packed']"
stage pretrain "$OUT/pretrain/final" smolctl pretrain recipes/smollm3-tiny.toml "$OUT/pretrain" --data "$OUT/packed"
stage report "$OUT/pretrain/report.html" smolctl report "$OUT/pretrain" --html "$OUT/pretrain/report.html"
stage midtrain "$OUT/midtrain/final" smolctl midtrain recipes/smollm3-tiny-midtrain.toml "$OUT/midtrain" \
  --from "$OUT/pretrain/final" --data "$OUT/packed-long"
stage sft "$OUT/sft/final" smolctl sft recipes/sft-tiny.toml "$OUT/sft" --from "$OUT/midtrain/final"
stage dpo "$OUT/dpo/final" smolctl dpo recipes/dpo-tiny.toml "$OUT/dpo" --from "$OUT/sft"
stage ppo "$OUT/ppo/final" smolctl ppo recipes/ppo-tiny.toml "$OUT/ppo" --from "$OUT/dpo"
stage stress-gpu - smolctl stress-gpu --duration 3s --devices cpu
stage benchmark-nccl - torchrun --nproc_per_node 2 -m smolctl benchmark-nccl --ops all_reduce,all_gather,all_to_all \
  --min-bytes 64K --max-bytes 1M --iters 5 --warmup 1

# The playbook's last steps: preference pairs sampled from a strong (DPO) and a weak (SFT) model, DPO on them as
# they are, then SmolLM3's final merge (preference-tuned model linear with the mid-training checkpoint, 0.9 / 0.1).
stage "generate (pairs)" "$OUT/pairs" smolctl generate "$DATA/prompts" "$OUT/pairs" --pairs \
  --chosen "$OUT/dpo" --rejected "$OUT/sft" --limit 16 --max-new-tokens 16
stage "dpo (generated pairs)" "$OUT/dpo-generated/final" smolctl dpo recipes/dpo-tiny.toml "$OUT/dpo-generated" \
  --from "$OUT/sft" --set data.path="$OUT/pairs" --set training.steps=2
stage merge "$OUT/merged" smolctl merge --method linear --model "$OUT/dpo-generated:0.9" \
  --model "$OUT/midtrain:0.1" "$OUT/merged"

smolctl inspect "$OUT/ppo/final" --samples 0 --lineage
python scripts/demo_summary.py "$OUT" "$OUT/ppo/final"
