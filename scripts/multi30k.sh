#!/usr/bin/env bash
# Multi30k task 1 En->De (29k training pairs) with the paper's recipe on a small model, sized for a CPU.
# Usage: scripts/multi30k.sh DATA_DIR [OUTPUT_DIR] [extra `vaswani train` options...]
#   DATA_DIR holds train.{en,de}.gz and test_2016_flickr.{en,de}.gz (Multi30k's raw text, one sentence a line).
set -euo pipefail
data=${1:?usage: scripts/multi30k.sh DATA_DIR [OUTPUT_DIR] [options...]}
output=${2:-multi30k_output}
shift $(( $# >= 2 ? 2 : 1 ))
exec vaswani train --output-dir "$output" --data files \
    --train "$data/train.en.gz" "$data/train.de.gz" \
    --test "$data/test_2016_flickr.en.gz" "$data/test_2016_flickr.de.gz" \
    --preset base \
    --model-override d_model=256 --model-override d_ff=1024 --model-override num_heads=4 \
    --model-override encoder_layers=3 --model-override decoder_layers=3 \
    --vocab-size 8000 --max-tokens 2560 --warmup-steps 600 --max-steps 2000 \
    --save-steps 200 --average-last 5 --logging-steps 50 "$@"
