#!/usr/bin/env bash
# The prepared device check (issue 27), one command on a GPU machine, <= 8 minutes:
#   bash scripts/gpu_check.sh OUT_DIR [stage ...]     (stages: probe [mps] tests runs overhead bench)
# Installs the wheels carried in .whl/ (packages the GPU image lacks: cryptography, pyeclib
# and what they need) into /tmp/site, runs stalwart from src/, writes OUT_DIR/gpu_check.json.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_check.sh OUT_DIR [stage ...]}
shift
mkdir -p "$out"
if ! python3 -c "import cryptography, pyeclib" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import stalwart.cli, cryptography, pyeclib, rich, matplotlib" || exit 1
python3 scripts/gpu_check.py "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
