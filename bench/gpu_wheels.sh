#!/usr/bin/env bash
# Builds .whl/, the wheels a bare GPU machine's image lacks for bench/gpu_suite.sh and
# bench/gpu_pending.sh (which install them into /tmp/site there): DeepSpeed (PyPI has only an
# sdist: built here without its ops, which it JIT-builds on first use) and the pure-Python or
# binary wheels it and the benchmarks need, at the versions of this checkout's .venv (run
# scripts/setup.sh first), for CPython $PY (default 3.12, the device image's) on x86-64 Linux.
#
#   bash bench/gpu_wheels.sh            # then: run(command="bash bench/gpu_pending.sh", carry=[".whl"])
#   PY=3.11 bash bench/gpu_wheels.sh    # another interpreter version on the device machine
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-3.12}
if [ ! -x .venv/bin/python ]; then
  echo "gpu_wheels: no .venv here; run bash scripts/setup.sh first" >&2
  exit 1
fi
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p .whl
DS=$(version deepspeed)
DS_BUILD_OPS=0 .venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==$DS"
pins=()
for p in hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions \
  omegaconf pytorch-optimizer zstandard; do
  pins+=("$p==$(version "$p")")
done
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
  --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl "${pins[@]}"
echo "gpu_wheels: .whl/ for CPython $PY:"
ls .whl
