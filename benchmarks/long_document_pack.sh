#!/bin/bash
# pack's peak memory and time on one document of MB megabytes of random words (default 30), beside the tokenizer
# encoding the same document whole in one call (what pack did before long documents were encoded in pieces).
# Usage: bash benchmarks/long_document_pack.sh [MB]   (from the repository root, after `make install`)
set -euo pipefail
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
.venv/bin/python - "${1:-30}" "$work/doc.parquet" <<'PY'
import sys, numpy as np, pyarrow as pa, pyarrow.parquet as pq
rng = np.random.default_rng(0)
words = np.array([''.join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(2, 9))) for _ in range(5000)])
n = int(float(sys.argv[1]) * 1e6 / 6)
pq.write_table(pa.table({"text": [" ".join(words[rng.integers(0, 5000, n)])]}), sys.argv[2])
PY
.venv/bin/python -m smolctl train-tokenizer data/sample/web "$work/tok" --vocab-size 8192 --json > /dev/null
printf 'tokenizer, whole document in one call: '
/usr/bin/time -f "rss=%M KB wall=%e s" .venv/bin/python -c "
import sys, pyarrow.parquet as pq
from tokenizers import Tokenizer
text = pq.read_table(sys.argv[1]).column('text')[0].as_py()
print(len(Tokenizer.from_file(sys.argv[2]).encode_batch_fast([text], add_special_tokens=False)[0].ids), 'tokens', end='; ')
" "$work/doc.parquet" "$work/tok/tokenizer.json"
printf 'smolctl pack: '
/usr/bin/time -f "rss=%M KB wall=%e s" .venv/bin/python -m smolctl pack "$work/doc.parquet" "$work/packed" \
  --tokenizer "$work/tok" --seq-len 4096 --json > /dev/null
