#!/usr/bin/env bash
# The CUDA path, checked on a machine with an NVIDIA GPU and a CUDA build of torch, transformers,
# scipy and pytest, with no model download:
#   1. the lossless and greedy-identity tests built on tiny random targets run with the targets
#      (and so their drafters, caches and verification) on the GPU (DSPARK_TEST_DEVICE=cuda);
#   2. a target of the bundled SmolLM2-135M's shape (its config and tokenizer, random weights: the
#      real weights are not needed to check kernels and shapes) generates greedily on the GPU with
#      the committed DSpark drafter, the n-gram hybrid and plain decoding, in fp32 and bf16, and
#      the speculative outputs must equal plain decoding's (fp32: token for token).
# Usage: scripts/cuda_check.sh SHAPE_DIR [OUT_DIR]
#   SHAPE_DIR holds config.json and the tokenizer files of the target (the folder `dspark` caches
#   the bundled model in, ~/.cache/dspark/models/SmolLM2-*, less its model.safetensors).
# Exit status: 0 when every check passed. Each check's output is in OUT_DIR. DEVICE=cpu runs the
# same checks on the CPU (how the script itself is tried without a GPU).
set -uo pipefail
SHAPE=${1:?usage: scripts/cuda_check.sh SHAPE_DIR [OUT_DIR]}
OUT_DIR=${2:-/tmp/dspark-cuda-check}
mkdir -p "$OUT_DIR"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
fail=0

"$PY" - <<'EOF' 2>&1 | tee "$OUT_DIR/device.txt"
import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA DEVICE")
EOF

# 1. the tiny-target tests (those that need the real bundled model are not among these files)
DSPARK_TEST_DEVICE=$DEVICE "$PY" -m pytest -q -p no:cacheprovider -o addopts="" --durations=5 \
    ${TESTS:-tests/test_verify.py tests/test_trained_drafters.py tests/test_confidence_policies.py \
    tests/test_auto_policy.py tests/test_runtime_prefix_cache.py tests/test_scheduling_outcome.py} \
    -k "not serving_policy" 2>&1 | tee "$OUT_DIR/pytest.txt" || fail=1

# 2. the real shape, random weights
TARGET="$OUT_DIR/smollm2-shape-random"
"$PY" - "$SHAPE" "$TARGET" <<'EOF' || fail=1
import shutil, sys
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
model.save_pretrained(dst)
for f in src.iterdir():
    if f.name != "config.json" and not f.name.endswith(".safetensors"):
        shutil.copy(f, dst / f.name)
print("random-weight target in", dst)
EOF
DRAFTER=dspark/checkpoints/smollm2-135m-instruct/dspark
PROMPT="Write a Python function that returns the n-th Fibonacci number, then explain it."
for dtype in fp32 bf16; do
  for spec in "dspark=$DRAFTER" "hybrid=ngram+$DRAFTER" "ngram=ngram"; do
    drafter=${spec#*=}
    tag="$dtype-${spec%%=*}"
    "$PY" -m dspark.cli generate --target "$TARGET" --drafter "$drafter" --device "$DEVICE" --dtype "$dtype" \
        --chat --compare --json --max-new-tokens "${MAX_NEW:-96}" --prompt "$PROMPT" > "$OUT_DIR/generate-$tag.txt" 2>&1
    rc=$?
    line=$(tail -n 1 "$OUT_DIR/generate-$tag.txt")
    same=$(printf '%s' "$line" | "$PY" -c 'import json,sys; d=json.loads(sys.stdin.read()); print(d.get("identical_to_plain"), d.get("num_tokens"), round(d.get("accept_length", 0), 3), round(d.get("speedup", 0) or 0, 3))' 2>/dev/null)
    echo "generate $tag: rc=$rc identical,tokens,accept,speedup=$same"
    if [ "$rc" -ne 0 ] || { [ "$dtype" = fp32 ] && [ "${same%% *}" != True ]; }; then fail=1; fi
  done
done 2>&1 | tee "$OUT_DIR/generate.txt"
grep -q "rc=[^0]\|fp32.*identical,tokens,accept,speedup=[^T]" "$OUT_DIR/generate.txt" && fail=1

echo "cuda check: $([ $fail -eq 0 ] && echo passed || echo FAILED)" | tee -a "$OUT_DIR/summary.txt"
exit $fail
