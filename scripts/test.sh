#!/usr/bin/env bash
# Sets up the environment (scripts/setup.sh) and runs lint + the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
ruff check .
ruff format --check .
# Two pytest-xdist workers (TEST_WORKERS=0: one process), one thread each: on 2 cores most tests
# keep one core busy. A module, and all the Slurm modules together, stay on one worker
# (tests/conftest.py). --durations: the slowest tests at the end of the log.
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
  python -m pytest -q -n "${TEST_WORKERS:-2}" --durations=25 "$@"
# The floating-point comparisons again on torch's portable kernels: tolerances must hold on every
# CPU (AVX2, AVX-512, AMX), not only on this one (tests/numerics.py). A compiler cache of its own:
# torch reuses graphs generated for this CPU's vector instructions under another capability, and
# their C++ then fails to compile (docs/troubleshooting.md).
if [ $# -eq 0 ]; then
  TORCHINDUCTOR_CACHE_DIR="${TMPDIR:-/tmp}/albatross-inductor-default-$(id -u)" \
    ATEN_CPU_CAPABILITY=default python -m pytest -q -m numerics
fi
