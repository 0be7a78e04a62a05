#!/usr/bin/env bash
# Multi30k task 1 (29k training pairs), En->De by default, any pair of Multi30k's files with SRC_LANG and TGT_LANG:
# the paper's recipe on Wu et al. (2021)'s `transformer_tiny` size (4+4 layers, d_model 128, FFN 256, 4 heads), a
# model sized for a small corpus and a 2-core CPU. Beyond the paper, each chosen on val: 4,096-token batches, Eq. 3 x 1.5
# with 800 warmup steps and a linear cooldown over the last 1,200 steps, the last checkpoint alone, 28.5 minutes of
# training (at most 6,000 steps), bf16 where it measures faster, GNMT alpha 1.4; validation BLEU every 400 steps.
# Test scores: README.md; the run's other scores and the settings measured on val: docs/results.md.
# Usage: [SRC_LANG=en TGT_LANG=de] scripts/multi30k.sh DATA_DIR [OUTPUT_DIR] [extra `vaswani train` options...]
#   DATA_DIR holds train, val and test_2016_flickr .$SRC_LANG.gz/.$TGT_LANG.gz (raw text, one sentence a line).
#   Later options win.
set -euo pipefail
data=${1:?usage: scripts/multi30k.sh DATA_DIR [OUTPUT_DIR] [options...]}
output=${2:-multi30k_output}
shift $(( $# >= 2 ? 2 : 1 ))
src=${SRC_LANG:-en}
tgt=${TGT_LANG:-de}
exec vaswani train --output-dir "$output" --data files --source-lang "$src" --target-lang "$tgt" \
    --train "$data/train.$src.gz" "$data/train.$tgt.gz" \
    --validation "$data/val.$src.gz" "$data/val.$tgt.gz" \
    --test "$data/test_2016_flickr.$src.gz" "$data/test_2016_flickr.$tgt.gz" \
    --preset base \
    --model-override d_model=128 --model-override d_ff=256 --model-override num_heads=4 \
    --model-override encoder_layers=4 --model-override decoder_layers=4 \
    --vocab-size 8000 --max-tokens 4096 --warmup-steps 800 --learning-rate-scale 1.5 --max-train-minutes 28.5 \
    --max-steps 6000 --cooldown-steps 1200 --save-steps 200 --average-last 1 --logging-steps 50 --bf16-if-faster \
    --length-penalty 1.4 --eval-bleu-steps 400 --eval-bleu-sample 500 "$@"
