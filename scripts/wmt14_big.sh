#!/usr/bin/env bash
# The paper's big model on WMT14 En->De (Table 3 "big"): d_model 1024, d_ff 4096, 16 heads, dropout 0.3,
# 300k steps, last 20 checkpoints averaged; everything else as scripts/wmt14_base.sh (later options win).
# Not run in CI.
set -euo pipefail
output=${1:-wmt14_big}
shift $(( $# >= 1 ? 1 : 0 ))
exec "$(dirname "$0")/wmt14_base.sh" "$output" --preset big --max-steps 300000 --average-last 20 "$@"
