#!/usr/bin/env bash
# The whole smolctl pipeline on the shipped sample corpus, on CPU. `make demo` runs this; it is also the
# shell script to copy onto a cluster login node (swap the sample folders for your data and the tiny recipe
# for recipes/smollm3.toml, and launch the training stages with torchrun or the sbatch files in recipes/slurm/).
set -euo pipefail
OUT=${1:-demo-out}
DATA=data/sample
rm -rf "$OUT" && mkdir -p "$OUT"

smolctl train-tokenizer "$DATA/web" "$OUT/tokenizer" --vocab-size 4096
smolctl inspect "$OUT/tokenizer" --samples 0
