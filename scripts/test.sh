#!/usr/bin/env bash
# Sets up the environment (scripts/setup.sh) and runs lint + the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
ruff check .
ruff format --check .
# The floating-point comparisons again on torch's portable kernels: tolerances must hold on every
# CPU (AVX2, AVX-512, AMX), not only on this one (tests/numerics.py). A compiler cache of its own:
# torch reuses graphs generated for this CPU's vector instructions under another capability, and
# their C++ then fails to compile (docs/troubleshooting.md). It runs beside the suite (a single
# process of seconds that fills the cores' idle moments); its log follows the suite's.
numerics_log=""
if [ $# -eq 0 ]; then
  numerics_log="$(mktemp)"
  TORCHINDUCTOR_CACHE_DIR="${TMPDIR:-/tmp}/albatross-inductor-default-$(id -u)" \
    ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 \
    python -m pytest -q -p no:cacheprovider -m numerics >"$numerics_log" 2>&1 &
  numerics_pid=$!
fi
# Two pytest-xdist workers (TEST_WORKERS=0: one process), one thread each: on 2 cores most tests
# keep one core busy. A module, and all the Slurm modules together, stay on one worker
# (tests/conftest.py). --durations: the slowest tests at the end of the log.
status=0
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
  python -m pytest -q -n "${TEST_WORKERS:-2}" --durations=25 "$@" || status=$?
if [ -n "$numerics_log" ]; then
  numerics_status=0
  wait "$numerics_pid" || numerics_status=$?
  echo "--- the numerics tests under ATEN_CPU_CAPABILITY=default:"
  cat "$numerics_log"
  rm -f "$numerics_log"
  [ "$status" -ne 0 ] || status=$numerics_status
fi
exit "$status"
