#!/usr/bin/env bash
# Each policy-gradient part of docs/ALGORITHM.md §4.5 on the demo task (configs/tiny.yaml),
# seed 0: one run per part through benchmarks/demo_seeds.py, one JSON line each in
# benchmarks/results/parts_demo.jsonl (first-20 and last-20 mean reward, val pass@1, time).
# The GSPO and CISPO runs take two optimizer steps per rollout (num_iterations 2) so that the
# ratio leaves 1 and their clip rules act (at one step per rollout the ratio is exactly 1).
# The overlong run's buffer is 1 token of the demo's 4: only a completion that hits the
# budget is punished (with 2, a right two-digit answer, 3 tokens with its stop, would be).
#   bash benchmarks/parts_demo.sh            # all parts, about 25 minutes on 2 cores
#   bash benchmarks/parts_demo.sh rloo cispo # some of them
#   python benchmarks/demo_seeds.py --report --out benchmarks/results/parts_demo.jsonl
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-$here/../.venv/bin/python}"
out="$here/results/parts_demo.jsonl"
obj=model.objective
# each part: its overrides, separated by ';'
declare -A parts=(
  [gspo]="$obj.loss_type=grpo;$obj.ratio_level=sequence;$obj.epsilon=3.0e-4;$obj.epsilon_high=4.0e-4;model.num_iterations=2"
  [gspo_token]="$obj.loss_type=grpo;$obj.ratio_level=sequence_token;$obj.epsilon=3.0e-4;$obj.epsilon_high=4.0e-4;model.num_iterations=2"
  [cispo]="$obj.loss_type=dapo;$obj.clip_rule=cispo;$obj.epsilon_high=4.0;model.num_iterations=2"
  [rloo]="$obj.advantage=rloo;$obj.scale_rewards=none"
  [reinforce_pp]="$obj.advantage=reinforce_pp"
  [reinforce_pp_baseline]="$obj.advantage=reinforce_pp_baseline"
  [kl_bias_correction]="$obj.kl_bias_correction=true"
  [overlong]="model.rewards={first_number: 1.0, overlong: {weight: 1.0, buffer: 1}}"
  [refill]="model.drop_constant_groups=true;model.refill_rounds=2"
)
order=(gspo gspo_token cispo rloo reinforce_pp reinforce_pp_baseline kl_bias_correction overlong
       refill)
chosen=("${@:-${order[@]}}")
for name in "${chosen[@]}"; do
  sets=()
  IFS=';' read -ra items <<< "${parts[$name]}"
  for kv in "${items[@]}"; do sets+=(--set "$kv"); done
  "$py" "$here/demo_seeds.py" --seeds 0 --workers 1 --threads 2 --label "part-$name" \
    --out "$out" "${sets[@]}"
done
"$py" "$here/demo_seeds.py" --report --out "$out"
