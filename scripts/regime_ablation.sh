#!/usr/bin/env bash
# Which regime should the target's training answers be sampled at? Three arms from the same
# drafter, the same steps, schedule, loss and learning rate, on the target's answers of one
# regenerated file: greedy answers only, temperature-1 answers only, and both. Each arm is scored
# on the same held-out rows of both regimes (teacher-forced, per block position), in
# <out>/<arm>/heldout.jsonl; the last lines print the table. Rerun to resume.
#
#   scripts/regime_ablation.sh REGEN_JSONL OUT [STEPS]
#
# REGEN_JSONL: `dspark regenerate --regimes greedy=0.5,t1=0.5` output (the recipe's <work>/regen/train.jsonl).
set -euo pipefail
regen=${1:?regenerated answers (JSONL)}; out=${2:?output folder}; steps=${3:-96}
bin=${DSPARK:-.venv/bin/dspark}
init=${INIT:-dspark/checkpoints/smollm2-135m-instruct/dspark}
mkdir -p "$out"
rows() {  # training rows of one arm: the corpus the trainer will build, counted
  .venv/bin/python - "$regen" "$1" <<'PY'
import sys
from dspark.runtime.loading import load_target
from dspark.training.corpus import build
t = load_target("smollm2-135m-instruct")
reg = None if sys.argv[2] == "both" else {sys.argv[2]}
print(len(build(t.tokenizer, {"regen": 1.0}, 10**9, regen_path=sys.argv[1], max_len=1024, log=lambda m: None,
                regimes=reg)[0]))
PY
}
for arm in greedy t1 both; do
  n=$(rows "$arm")
  epochs=$(python3 -c "import math; print($steps / math.ceil($n / 8))")
  flag=(); [ "$arm" != both ] && flag=(--regimes "$arm")
  "$bin" train --recipe dspark --layers 3 --markov-rank 128 --corpus --mix regen=1 --input "$regen" "${flag[@]}" \
    --positions 1000000000 --max-len 1024 --batch-size 8 --anchors 0 --epochs "$epochs" --loss kl+tv \
    --loss-decay 0 --schedule wsd --lr 6e-4 --eval-every $((steps / 6)) --init-weights "$init" \
    --out "$out/$arm" --threads 2 > "$out/$arm.json"
done
.venv/bin/python scripts/regime_table.py "$out"/greedy "$out"/t1 "$out"/both
