#!/usr/bin/env bash
# Sets up the environment and runs the main job end to end on the embedded default corpus: the
# `main` study (configs/studies/main.yaml) at its `demo` scale, with the local executor.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python -m study run configs/studies/main.yaml --scale "${SCALE:-demo}" --out "${OUT:-runs/main}" "$@"
