#!/bin/bash
# The data pipeline and pretraining as dependent Slurm jobs: train-tokenizer → dedup → mix → pack → pretrain.
#
#   DATA=data/sample OUT=out bash recipes/slurm/pipeline.sh
#   DATA=/data/corpus OUT=/data/run1 MIX_RECIPE=recipes/smollm3-mix.toml PACK_ARGS="--seq-len 4096" TASKS=256 \
#       PRETRAIN_RECIPE=recipes/smollm3.toml PRETRAIN_SBATCH_ARGS="--nodes 48" bash recipes/slurm/pipeline.sh
#
# Submits every job at once, each waiting for the ones before it (--dependency=afterok), and prints one line per
# job: `STEP JOBID`. A failed job leaves the rest pending (reason DependencyNeverSatisfied): fix it, scancel them,
# and submit again; finished units and stages are skipped. The folders are those of these commands run one after
# the other on one machine, as scripts/demo.sh does:
#   smolctl train-tokenizer TOKENIZER_INPUT OUT/tokenizer TOKENIZER_ARGS
#   smolctl dedup DATA/SOURCE OUT/dedup/SOURCE DEDUP_ARGS      for each SOURCE     (recipes/slurm/dedup.sbatch)
#   smolctl mix OUT/mix --recipe MIX_RECIPE --tokenizer OUT/tokenizer \
#       --set sources.SOURCE.path=OUT/dedup/SOURCE ... MIX_ARGS                     (recipes/slurm/mix.sbatch)
#   smolctl pack OUT/mix/PACK_STAGE OUT/packed --tokenizer OUT/tokenizer PACK_ARGS  (recipes/slurm/pack.sbatch)
#   smolctl pretrain PRETRAIN_RECIPE OUT/pretrain --data OUT/packed PRETRAIN_ARGS   (recipes/slurm/pretrain.sbatch)
#
# Settings (environment variables; the defaults are `make demo`'s data stages):
#   DATA, OUT              the corpus (one folder per source) and the folder for every output (required)
#   SOURCES                source folders under DATA (default "web code math")
#   TOKENIZER_INPUT        what the tokenizer trains on (default DATA/web); TOKENIZER_ARGS (default "--vocab-size
#                          4096"; add e.g. "--sample-bytes 2GB" for a large corpus)
#   DEDUP_ARGS             (default "--minhash"); BANDS: array size of dedup's buckets stage (default 20)
#   MIX_RECIPE             (default recipes/demo-mix.toml, its sources replaced by OUT/dedup/SOURCE); MIX_ARGS
#   PACK_STAGE             the mix stage to pack (default stage-1; empty: the whole mix, stage by stage)
#   PACK_ARGS              (default "--seq-len 256")
#   PRETRAIN_RECIPE        (default recipes/smollm3-tiny.toml; empty: stop after pack); PRETRAIN_ARGS: more
#                          pretrain options; PRETRAIN_SBATCH_ARGS: sbatch options of that job (e.g. "--nodes 48")
#   TASKS                  array size of every data array (default 64)
#   SBATCH_ARGS            extra sbatch options for every job (e.g. "--partition cpu --account proj")
#   SMOLCTL                the smolctl executable for the data jobs (default: smolctl on PATH)
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
: "${DATA:?set DATA to the corpus folder (one folder per source)}"
: "${OUT:?set OUT to the folder for the outputs}"
SOURCES=${SOURCES:-web code math}
TOKENIZER_INPUT=${TOKENIZER_INPUT:-$DATA/web}
TOKENIZER_ARGS=${TOKENIZER_ARGS:---vocab-size 4096}
MIX_RECIPE=${MIX_RECIPE:-$HERE/../demo-mix.toml}
PACK_STAGE=${PACK_STAGE-stage-1}
PACK_ARGS=${PACK_ARGS:---seq-len 256}
PRETRAIN_RECIPE=${PRETRAIN_RECIPE-$HERE/../smollm3-tiny.toml}
SMOLCTL=${SMOLCTL:-smolctl}
MIX_ARGS=" ${MIX_ARGS:-}"
export TASKS=${TASKS:-64} SBATCH_ARGS=${SBATCH_ARGS:-} SMOLCTL
mkdir -p logs "$OUT"

# shellcheck disable=SC2086  # SBATCH_ARGS and TOKENIZER_ARGS are lists
tokenizer=$(sbatch --parsable $SBATCH_ARGS --job-name=smolctl-tokenizer --output='logs/%x-%j.out' \
    --wrap="$(printf '%q ' "$SMOLCTL" train-tokenizer "$TOKENIZER_INPUT" "$OUT/tokenizer") $TOKENIZER_ARGS")
echo "tokenizer $tokenizer"

filters=()
for source in $SOURCES; do
    filter=$(INPUT="$DATA/$source" OUTPUT="$OUT/dedup/$source" AFTER=$tokenizer bash "$HERE/dedup.sbatch")
    echo "dedup-$source $filter"
    filters+=("$filter")
    MIX_ARGS+=" --set sources.$source.path=$OUT/dedup/$source"
done

mix=$(OUTPUT="$OUT/mix" AFTER=$(IFS=:; echo "${filters[*]}") \
    MIX_ARGS="--recipe $MIX_RECIPE --tokenizer $OUT/tokenizer$MIX_ARGS" bash "$HERE/mix.sbatch")
echo "mix $mix"

pack=$(INPUT="$OUT/mix${PACK_STAGE:+/$PACK_STAGE}" OUTPUT="$OUT/packed" TOKENIZER="$OUT/tokenizer" AFTER=$mix \
    PACK_ARGS=$PACK_ARGS bash "$HERE/pack.sbatch")
echo "pack $pack"

if [[ -n $PRETRAIN_RECIPE ]]; then
    # shellcheck disable=SC2086  # the *_ARGS are lists
    pretrain=$(sbatch --parsable $SBATCH_ARGS ${PRETRAIN_SBATCH_ARGS:-} --dependency=afterok:"$pack" \
        "$HERE/pretrain.sbatch" "$PRETRAIN_RECIPE" "$OUT/pretrain" --data "$OUT/packed" ${PRETRAIN_ARGS:-})
    echo "pretrain $pretrain"
fi
