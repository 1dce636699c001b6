#!/usr/bin/env bash
# Swap the demo-model training run's latest checkpoint into freetoken_py/data/demo_model/ and
# measure it against the model it replaces (held-out eval, one JSON line), then run the demo
# model's tests and the README's first command.
#
#   scripts/finish_demo_model.sh [RUN]          (RUN defaults to "main")
#
# The replaced model is kept in $WORK/replaced_demo_model/ (also in git: `git checkout
# freetoken_py/data/demo_model` brings it back). The eval's line is appended to $WORK/eval.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-main}
WORK=${FREETOKEN_DEMO_WORK:-$HOME/.cache/freetoken-demo-train}
DEMO=${DEMO_TARGET:-freetoken_py/data/demo_model}   # DEMO_TARGET=/tmp/x: a dry run elsewhere
OLD=$WORK/replaced_demo_model

rm -rf "$OLD" "$WORK/export-$RUN"
cp -r "$DEMO" "$OLD"
python scripts/train_demo_model.py --run "$RUN" --work-dir "$WORK" --export-only --out "$WORK/export-$RUN"
rm -rf "$DEMO"
cp -r "$WORK/export-$RUN" "$DEMO"
python scripts/eval_demo_model.py --old "$OLD" --new "$DEMO" --show 3 | tee -a "$WORK/eval.jsonl"
if [ "$DEMO" = freetoken_py/data/demo_model ]; then
  python -m pytest -q tests/test_demo_model.py
  python -m freetoken_py run "import os" --max-tokens 64 --temperature 0
fi
