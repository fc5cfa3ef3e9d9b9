#!/usr/bin/env bash
# Create benchmarks/.venv-trl: an isolated environment with TRL for the side-by-side benchmark.
#
# torch is pinned FIRST to the CPU build the main environment uses (an unpinned torch would pull
# a multi-GB CUDA build); transformers is pinned to the version of the main environment so both
# sides run the same model code. Uses pip (not uv). Re-running is safe: pip skips what is there.
#
# Usage: bash benchmarks/setup_trl_venv.sh [PYTHON]   (default: python3)
# TRL_VERSION=x.y.z picks another TRL release (default: the one RESULTS.md was measured with).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$here/.venv-trl"
python="${1:-python3}"
main_pip="$here/../.venv/bin/pip"

if [[ -x "$main_pip" ]]; then
    tf_version="$("$main_pip" show transformers 2>/dev/null | awk '/^Version:/{print $2}' || true)"
fi
tf_version="${tf_version:-5.24.0}"

if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv"
fi
rm -f "$venv/.installed"  # the mark of a finished install; tests wait for it
pip=("$venv/bin/python" -m pip)

"${pip[@]}" install "torch==2.13.0"
"${pip[@]}" install "transformers==$tf_version" "trl==${TRL_VERSION:-1.16.0}"
"$venv/bin/python" - <<'PY'
import torch, transformers, trl
print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}")
PY
touch "$venv/.installed"
