#!/usr/bin/env bash
# The pending GPU figures of BENCHMARKS.md ("Pending GPU figures") in ONE call of about 9 minutes,
# as passes of bench/gpu_suite.sh, most important first, each skipped when too little of the
# time budget is left; everything ends up in one archive so that it comes back in one file:
#
#   bash bench/gpu_pending.sh          # -> $OUT/pending.tgz (one folder per pass) + $OUT/pending.log
#   BUDGET=300 bash bench/gpu_pending.sh   # seconds for all the passes (default 540)
#   ONLY="compile_check" BUDGET=200 bash bench/gpu_pending.sh   # only those passes
#
# On the device machine: run(command="bash bench/gpu_pending.sh", carry=[".whl"], timeout_s=600).
# Passes: 1 cayley (the orthogonal maps by block inverse vs LU, TransJect's expert block batched
# vs broadcast, then softmax and TransJect in the trainer: the TransJect target), 2-5
# sdpa_<order>_<padding> (cuDNN attention first against torch's own order, unpadded then padded,
# softmax and TISA at albert-base seq 512: the softmax MFU and TISA targets), 6 compile_check
# (where compiled TransJect goes non-finite; scoped inductor modes follow when it does),
# 7 scaling_nomask (the scaling part, softmax on flash/cuDNN: the kernel target), 8 accum8
# (softmax and TransJect at accumulation 8), 9 large_transject_64 (TransJect's albert-large peak
# memory at micro-batch 64). What the budget leaves out is named in pending.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu_pending}
BUDGET=${BUDGET:-540}
SUITE=${SUITE:-bench/gpu_suite.sh}
ONLY=${ONLY:-} # pass names to run (a second call: ONLY="compile_check scaling_nomask"); empty: all
mkdir -p "$OUT/passes"
LOG=$OUT/pending.log
: >"$LOG"
START=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - START))); }

pass() { # pass NAME MIN_S VAR=VALUE...: one run of the suite into $OUT/passes/NAME
  local name=$1 need=$2
  shift 2
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
  if [ "$(left)" -lt "$need" ]; then
    echo "=== pass $name: skipped, $(left) s left of $BUDGET (needs $need)" | tee -a "$LOG"
    return 0
  fi
  echo "=== pass $name ($(left) s left): $*" | tee -a "$LOG"
  env OUT="$OUT/passes/$name" PRETRAIN_LIMIT="$(($(left) < 150 ? $(left) : 150))" "$@" \
    bash "$SUITE" 2>&1 | tee -a "$LOG"
  echo "=== pass $name: done at $(($(date +%s) - START)) s" | tee -a "$LOG"
}

pass cayley 150 PARTS="cayley tjexperts pretrain" \
  "PRETRAIN=--configs albert-base-512 --families softmax transject --steps 6"
# Only the first pass prints the environment (nvidia-smi, versions): ENV_PART= in the others.
for PAD in none one-short-row; do
  for ORDER in default cudnn; do
    SDPA=""
    if [ "$ORDER" = cudnn ]; then SDPA="--sdpa-priority cudnn flash efficient math"; fi
    pass "sdpa_${ORDER}_$PAD" 60 ENV_PART= PARTS=pretrain \
      "PRETRAIN=--configs albert-base-512 --families softmax tisa --padding $PAD --steps 6 $SDPA"
  done
done
pass compile_check 200 ENV_PART= PARTS=compilecheck
pass scaling_nomask 60 ENV_PART= PARTS=scaling SCALING=--no-mask
pass accum8 60 ENV_PART= PARTS=pretrain \
  "PRETRAIN=--configs albert-base-512 --families softmax transject --accumulation 8 --steps 4 --warmup 2"
# TransJect at albert-large, micro-batch 64 (the recipe runs 32 x 2 since it peaked at 84.4 GB
# with the expert stacks' broadcast copies, gone now): does 64 x 1 fit an 80 GB card again?
pass large_transject_64 60 ENV_PART= PARTS=pretrain \
  "PRETRAIN=--configs albert-large-512 --families transject --batch 64 --steps 4 --warmup 2"
echo "=== all passes done in $(($(date +%s) - START)) s" | tee -a "$LOG"
tar -czf "$OUT/pending.tgz" -C "$OUT" passes && rm -rf "$OUT/passes"
ls -la "$OUT" | tee -a "$LOG"
