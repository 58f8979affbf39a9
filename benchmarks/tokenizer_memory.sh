#!/bin/bash
# train-tokenizer's peak memory and time on one document of MB megabytes of random words (default 30).
# Usage: bash benchmarks/tokenizer_memory.sh [MB]   (from the repository root, after `make install`)
set -euo pipefail
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
.venv/bin/python - "${1:-30}" "$work/hrepro.parquet" <<'PY'
import sys, numpy as np, pyarrow as pa, pyarrow.parquet as pq
rng = np.random.default_rng(0)
words = np.array([''.join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(2, 9))) for _ in range(5000)])
n = int(float(sys.argv[1]) * 1e6 / 6)
pq.write_table(pa.table({"text": [" ".join(words[rng.integers(0, 5000, n)])]}), sys.argv[2])
PY
/usr/bin/time -f "rss=%M KB wall=%e s" .venv/bin/python -m smolctl train-tokenizer "$work/hrepro.parquet" \
  "$work/tok" --vocab-size 2000 --json > /dev/null
