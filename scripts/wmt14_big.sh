#!/usr/bin/env bash
# The paper's big model on WMT14 En->De (Table 3 "big"): d_model 1024, d_ff 4096, 16 heads, dropout 0.3,
# 300k steps, last 20 checkpoints averaged; otherwise as scripts/wmt14_base.sh. Not run in CI.
set -euo pipefail
output=${1:-wmt14_big}
shift $(( $# >= 1 ? 1 : 0 ))
exec vaswani train --output-dir "$output" --data hub --hub-name wmt14 --hub-config de-en \
    --source-lang en --target-lang de --preset big --vocab-size 37000 \
    --max-tokens 3125 --update-freq 8 --warmup-steps 4000 --max-steps 300000 \
    --save-steps 1500 --average-last 20 --label-smoothing 0.1 --bf16 "$@"
