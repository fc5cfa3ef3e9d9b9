#!/usr/bin/env bash
# The GPU figures (issues 13 and 37), prepared for one device lease: every stage under its own
# time limit and all of them under one deadline, so that one command fits the lease:
#
#   DEADLINE_S=540 bash benchmarks/gpu_issue13.sh OUT
#
# OUT: where the JSON files go (default /tmp/gpu_out); every log goes into OUT/logs.tgz.
# Stages (STAGES picks them, in this order by default):
#   1. scoring   benchmarks/gpu_scoring.py at the issue shape: plain vs blocks vs fused head,
#                time, peak memory / bf16 logits, and each variant's largest difference from
#                the plain formula (log-probs, entropy, both gradients);
#   2. step      benchmarks/gpu_step.py: ours (dynamic, static, static + bf16 copy; the fused
#                head on by default on CUDA) and TRL (run second, before the compiled sides),
#                median step, tokens/s, peak memory and peak memory by phase; a side that
#                fails or runs past its limit is recorded and the others still run;
#   3. cli       the default demo (configs/tiny.yaml) through `python -m maxent_grpo fit` on
#                the GPU, bf16-mixed, CLI_STEPS steps (default 200): the user's own path on
#                CUDA; its logged scalars go to OUT/cli_run.json;
#   4. generate  benchmarks/gpu_generate.py, the variants that decide the engine: ours static
#                (+ bf16 copy) and transformers' continuous batching with CUDA graphs, with
#                whatever time the deadline leaves.
# PYTHON picks the interpreter. Rehearse every stage on a CPU with SHAPE=tiny-cpu (the tiny
# shapes of each script; `cli` then runs on the CPU).
#
# On the lent GPU machine (no network) the packages it lacks travel as cp312 wheels in
# .whl/ (the device tool's README says how): jsonargparse, docstring-parser, typeshed-client,
# math-verify, latex2sympy2-extended, antlr4-python3-runtime, datasets, dill, multiprocess
# and trl, installed with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
# before this script.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-/tmp/gpu_out}"
PYTHON="${PYTHON:-python3}"
STAGES="${STAGES:-scoring step cli generate}"
SHAPE="${SHAPE:-gpu}"
CLI_STEPS="${CLI_STEPS:-200}"
DEADLINE_S="${DEADLINE_S:-540}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT/logs"
case "$PYTHON" in  # absolute, since the cli stage runs in another folder
  */*) PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")" ;;
esac
cd "$REPO"
START=$SECONDS

# the stage's limit: its own cap, or what is left before the deadline (less 10 s to pack)
limit() {
  local left=$((DEADLINE_S - (SECONDS - START) - 10))
  ((left < $1)) && echo "$left" || echo "$1"
}

"$PYTHON" - <<'EOF' || exit 1
import importlib.metadata as md
import torch
found = []
for name in ("torch", "transformers", "lightning", "trl", "accelerate", "datasets", "pyarrow",
             "huggingface-hub", "jsonargparse", "math-verify", "triton"):
    try:
        found.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        found.append(f"{name} absent")
print(", ".join(found))
print("device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu only")
EOF
git log -1 --format='commit %H %cd' 2>/dev/null || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true

if [ "$SHAPE" = gpu ]; then
  SCORING_SHAPE=() GENERATE_SHAPE=() ACCELERATOR=gpu
else
  SCORING_SHAPE=(--n 2 --t 16 --v 1000 --h 64) GENERATE_SHAPE=(--shape "$SHAPE")
  ACCELERATOR=cpu
fi

for stage in $STAGES; do
  echo "=== $stage ($(date +%T), $((SECONDS - START)) s of $DEADLINE_S)"
  case "$stage" in
    scoring)
      timeout "$(limit 90)" "$PYTHON" benchmarks/gpu_scoring.py --repeats 3 "${SCORING_SHAPE[@]}" \
        --out "$OUT/gpu_scoring.json" 2>&1 | tee "$OUT/logs/gpu_scoring.log" ;;
    step)
      timeout "$(limit 330)" "$PYTHON" benchmarks/gpu_step.py --shape "$SHAPE" \
        --trl-python "$PYTHON" --trl-second --timeout 150 --log-dir "$OUT/logs" \
        --out "$OUT/gpu_step.json" 2>&1 | tee "$OUT/logs/gpu_step.log" ;;
    cli)
      rm -rf /tmp/gpu_cli && mkdir -p /tmp/gpu_cli && cp -rL configs /tmp/gpu_cli/ &&
      (cd /tmp/gpu_cli && timeout "$(limit 75)" "$PYTHON" -m maxent_grpo fit \
        --config configs/tiny.yaml --trainer.accelerator "$ACCELERATOR" \
        --trainer.precision bf16-mixed --trainer.max_steps "$CLI_STEPS" \
        --trainer.val_check_interval 100 --trainer.enable_progress_bar false) \
        2>&1 | tee "$OUT/logs/cli.log"
      "$PYTHON" - "$OUT/cli_run.json" <<'EOF'
import json, statistics, sys
from maxent_grpo.analysis.runs import find_runs, load_run
run = load_run(find_runs("/tmp/gpu_cli/lightning_logs")[0])
keep = ("train/reward/mean", "train/perf/step_s", "train/perf/generate_s", "train/kl",
        "train/grad_norm", "train/loss/total", "val/pass@1", "val/pass@4")
found = {k: {"steps": list(s.steps), "values": list(s.values)}
         for k, s in run.scalars.items() if k in keep}
json.dump(found, open(sys.argv[1], "w"))
reward = found["train/reward/mean"]["values"]
step = found["train/perf/step_s"]["values"]
print(f"cli: {len(reward)} steps; reward mean, first 20: {statistics.mean(reward[:20]):.3f}, "
      f"last 20: {statistics.mean(reward[-20:]):.3f}; median step {statistics.median(step):.3f} s")
EOF
      ;;
    generate)
      left=$(limit 240)
      if ((left < 60)); then echo "generate: $left s left, skipped"; continue; fi
      timeout "$left" "$PYTHON" benchmarks/gpu_generate.py --repeats 2 "${GENERATE_SHAPE[@]}" \
        --timeout $((left / 2 - 5)) --variants ours-static-bf16copy,cb-graphs \
        --out "$OUT/gpu_generate.json" 2>&1 | tee "$OUT/logs/gpu_generate.log" ;;
    *) echo "unknown stage $stage (scoring, step, cli, generate)"; exit 2 ;;
  esac
  echo "=== $stage exit ${PIPESTATUS[0]} ($(date +%T), $((SECONDS - START)) s)"
done
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
