#!/usr/bin/env bash
# Multi30k task 1 (29k training pairs), En->De by default, any pair of Multi30k's files with SRC_LANG and TGT_LANG.
# The recipes train Wu et al. (2021)'s text-only `transformer_tiny` (4+4 layers, d_model 128, FFN 256, 4 heads) on
# their text: lowercased and Moses-tokenized into OUTPUT_DIR/prepared (scripts/prepare_multi30k.py, kept once
# complete), subword-nmt's BPE with 10,000 merges, dropout 0.3, updates of two 3,800-token batches, Eq. 3 x 2.53 with
# 2,000 warmup updates (their peak 0.005), label smoothing 0.1, beam 5 dividing by length^1.0.
# Default recipe, for a 2-core CPU: fairseq's initialisation, 28 minutes of training (at most 8,000 updates) in bf16
# where it measures faster, a linear cooldown over the last 1,000 updates, the last checkpoint alone; greedy
# validation BLEU every 1,000 updates (each chosen on val).
# --recipe ensemble, within 90 minutes on 2 cores: two members of the default recipe, seeds --seed (default 0) and
# --seed + 1, trained side by side on half the cores each for 85 minutes, beam 5 dividing by length^1.4, decoded
# together as an ensemble (`vaswani evaluate MODEL MODEL`) into OUTPUT_DIR/results.json; each member's run, log and
# own scores in OUTPUT_DIR/member-N and member-N.log (the ensemble and the penalty chosen on val).
# --recipe published: Wu et al. (2021)'s fairseq run (41.02 BLEU) as it was: 8,000 updates, validation loss every
# epoch with patience 10, the last 10 epoch checkpoints averaged; results.json's whitespace_bleu is the number to
# compare. Scores and settings of each: README.md and docs/results.md.
# Usage: [SRC_LANG=en TGT_LANG=de] scripts/multi30k.sh DATA_DIR [OUTPUT_DIR] [--recipe published|ensemble] [options...]
#   DATA_DIR holds train, val and test_2016_flickr .$SRC_LANG.gz/.$TGT_LANG.gz (raw text, one sentence a line).
#   The options go to `vaswani train` (later ones win); --resume continues an interrupted run.
set -euo pipefail
usage="usage: scripts/multi30k.sh DATA_DIR [OUTPUT_DIR] [--recipe published|ensemble] [options...]"
data=${1:?$usage}
output=${2:-multi30k_output}
shift $(( $# >= 2 ? 2 : 1 ))
recipe=default
if [[ ${1:-} == --recipe ]]; then
    recipe=${2:?$usage}
    shift 2
fi
src=${SRC_LANG:-en}
tgt=${TGT_LANG:-de}

if [[ $recipe != default && $recipe != published && $recipe != ensemble ]]; then
    echo "scripts/multi30k.sh: error: --recipe must be published or ensemble (or default), got '$recipe'" >&2
    exit 2
fi

text=$output/prepared
if [[ ! -d $text ]]; then  # renamed into place once whole: a folder by that name is complete
    rm -rf "$text.partial"
    python3 "$(dirname "$0")/prepare_multi30k.py" "$data" "$text.partial" --source-lang "$src" --target-lang "$tgt"
    mv "$text.partial" "$text"
fi
# The corpus, Wu et al. (2021)'s `transformer_tiny` and their regularisation, optimiser, batches and beam. Eq. 3 x
# 0.005 sqrt(2000 x 128) is fairseq's inverse_sqrt with lr 0.005 and 2,000 warmup updates at d_model 128; 3,800 tokens
# x 2 batches an update are about the anchor's 2 GPUs x 4,096 tokens (docs/results.md).
common=(--data files --source-lang "$src" --target-lang "$tgt"
    --train "$text/train.$src.gz" "$text/train.$tgt.gz" --validation "$text/val.$src.gz" "$text/val.$tgt.gz"
    --test "$text/test_2016_flickr.$src.gz" "$text/test_2016_flickr.$tgt.gz"
    --preset base --model-override d_model=128 --model-override d_ff=256 --model-override num_heads=4
    --model-override encoder_layers=4 --model-override decoder_layers=4 --model-override dropout=0.3
    --model-override layer_norm_eps=1e-5 --model-override positional_encoding=fairseq_sinusoidal
    --bpe subword_nmt --bpe-merges 10000 --max-tokens 3800 --update-freq 2 --warmup-steps 2000
    --learning-rate-scale 2.5298221281347035 --max-steps 8000 --adam-epsilon 1e-8 --max-grad-norm 25
    --label-smoothing 0.1 --num-beams 5 --length-penalty 1.0 --length-penalty-type power)

if [[ $recipe == published ]]; then
    exec vaswani train "${common[@]}" --output-dir "$output" --save-every-epoch --average-last 10 \
        --early-stopping-metric loss --early-stopping-patience 10 --seed 1 "$@"
fi
budgeted=("${common[@]}" --model-override initialization=fairseq --cooldown-steps 1000 --save-steps 250
    --average-last 1 --logging-steps 50 --bf16-if-faster --eval-bleu-steps 1000 --eval-bleu-sample 500)
if [[ $recipe == default ]]; then
    exec vaswani train "${budgeted[@]}" --output-dir "$output" --max-train-minutes 28 "$@"
fi

# --recipe ensemble: two members side by side, each on half the cores, seeds --seed (default 0) and --seed + 1
seed=0
options=()
while (( $# )); do
    case $1 in
        --seed) seed=${2:?"scripts/multi30k.sh: error: --seed needs a value"}; shift 2 ;;
        --seed=*) seed=${1#--seed=}; shift ;;
        *) options+=("$1"); shift ;;
    esac
done
if [[ ! $seed =~ ^[0-9]+$ ]]; then
    echo "scripts/multi30k.sh: error: --seed must be a whole number, got '$seed'" >&2
    exit 2
fi
threads=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT  # a member left running when the other fails or the script stops
for member in 0 1; do
    OMP_NUM_THREADS=$threads vaswani train "${budgeted[@]}" --output-dir "$output/member-$member" \
        --max-train-minutes 85 --length-penalty 1.4 --seed $(( seed + member )) "${options[@]}" \
        >"$output/member-$member.log" 2>&1 &
done
for _ in 0 1; do
    if ! wait -n; then
        echo "scripts/multi30k.sh: error: a member's training failed: see $output/member-0.log and $output/member-1.log" >&2
        exit 1
    fi
done
vaswani evaluate "$output/member-0/model" "$output/member-1/model" --target-lang "$tgt" \
    --source "$text/test_2016_flickr.$src.gz" --reference "$text/test_2016_flickr.$tgt.gz" >"$output/results.json.partial"
mv "$output/results.json.partial" "$output/results.json"
cat "$output/results.json"
