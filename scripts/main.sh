#!/usr/bin/env bash
# Sets up the environment and runs the main job end to end on the embedded default corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python -m main_job --out "${OUT:-runs/main}" "$@"
