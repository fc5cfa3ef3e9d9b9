#!/usr/bin/env bash
# Issue 13's GPU figures, prepared for a device lease of 10 minutes a command:
#
#   STAGES="scoring step" bash benchmarks/gpu_issue13.sh OUT   # ~8.5 minutes at most
#   STAGES=generate bash benchmarks/gpu_issue13.sh OUT         # ~4 minutes at most
#
# OUT: where the JSON files and logs go (default /tmp). Stages, each under its own limit:
#   1. scoring   benchmarks/gpu_scoring.py at the issue shape: plain vs blocks vs fused head,
#                time and peak memory / bf16 logits (about 1 minute);
#   2. step      benchmarks/gpu_step.py: ours (dynamic, static, static + bf16 copy; the fused
#                head on by default on CUDA) and TRL, median step, tokens/s, peak memory and
#                peak memory by phase (about 5 minutes);
#   3. generate  benchmarks/gpu_generate.py, the variants that decide the engine: HF static,
#                ours static (+ bf16 copy) and continuous batching with CUDA graphs.
# STAGES (environment) picks the stages (default all three, ~12.5 minutes at most: more than
# one command may run); PYTHON picks the interpreter.
#
# On the lent GPU machine (no network) the packages it lacks travel as cp312 wheels in
# .whl/ (the device tool's README says how): jsonargparse, docstring-parser, typeshed-client,
# datasets (+ dill, multiprocess, xxhash, pyarrow if absent) and trl, installed with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
# before this script.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-/tmp}"
PYTHON="${PYTHON:-python3}"
STAGES="${STAGES:-scoring step generate}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
cd "$REPO"

"$PYTHON" - <<'EOF' || exit 1
import torch, transformers
if not torch.cuda.is_available():
    raise SystemExit("gpu_issue13: no CUDA device visible")
print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
      f"{torch.cuda.get_device_name(0)}")
EOF
git log -1 --format='commit %H %cd' 2>/dev/null || true

for stage in $STAGES; do
  echo "=== $stage ($(date +%T))"
  case "$stage" in
    scoring)
      timeout 120 "$PYTHON" benchmarks/gpu_scoring.py --repeats 3 \
        --out "$OUT/gpu_scoring.json" 2>&1 | tee "$OUT/gpu_scoring.log" ;;
    step)
      timeout 390 "$PYTHON" benchmarks/gpu_step.py --trl-python "$PYTHON" --timeout 240 \
        --out "$OUT/gpu_step.json" 2>&1 | tee "$OUT/gpu_step.log" ;;
    generate)
      timeout 240 "$PYTHON" benchmarks/gpu_generate.py --repeats 2 \
        --variants hf-static,ours-static,ours-static-bf16copy,cb-graphs \
        --out "$OUT/gpu_generate.json" 2>&1 | tee "$OUT/gpu_generate.log" ;;
    *) echo "unknown stage $stage (scoring, step, generate)"; exit 2 ;;
  esac
  echo "=== $stage exit ${PIPESTATUS[0]} ($(date +%T))"
done
