#!/usr/bin/env bash
# Creates .venv (if absent) and installs the project with its test and docs extras.
# torch is installed first, pinned to 2.13.0 (a CPU build that pip finds locally here); on a GPU
# cluster, install your CUDA torch into the venv first and this script keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# --no-compile, then one compileall on every core: pip compiles the packages' bytecode one file
# at a time (about half of this script's time on 2 cores).
if ! python -c "import torch" >/dev/null 2>&1; then
  python -m pip install -q --no-compile "torch==${TORCH_VERSION:-2.13.0}"
fi
python -m pip install -q --no-compile -e ".[test,docs]"
# `|| true`: some packages ship files that are not Python 3 (pip's own compilation skips them).
python -m compileall -q -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
  >/dev/null || true
python -c "import torch, model; print(f'albatross ready: torch {torch.__version__}')"
