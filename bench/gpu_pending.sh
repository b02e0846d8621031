#!/usr/bin/env bash
# The pending GPU figures of BENCHMARKS.md ("Pending GPU figures") in ONE call of about 9 minutes,
# as passes of bench/gpu_suite.sh, most important first, each skipped when too little of the
# time budget is left; everything ends up in one archive so that it comes back in one file:
#
#   bash bench/gpu_pending.sh          # -> $OUT/pending.tgz (one folder per pass) + $OUT/pending.log
#   BUDGET=300 bash bench/gpu_pending.sh   # seconds for all the passes (default 540)
#   ONLY="syncs_compiled" BUDGET=200 bash bench/gpu_pending.sh   # only those passes
#   PLAN=1 bash bench/gpu_pending.sh   # runs nothing: the passes a call would start if each
#                                      # took its whole time limit (no GPU needed)
#
# On the device machine: run(command="bash bench/gpu_pending.sh", carry=[".whl"], timeout_s=600),
# .whl/ made first here by bash bench/gpu_wheels.sh (a fresh checkout has none).
# Passes, in this order (the targets of BENCHMARKS "Performance targets" each pass measures;
# the passes of the previous list that ran are in BENCHMARKS, "GPU: the recipes compiled"):
#  T targets: the three ratio targets and softmax's MFU in one pass, every pending model option
#    on at once: softmax, TISA on the split backend and TransJect with its three (Gauss-Jordan
#    leaves, bf16x3 eigen-products, the bf16 residual stream), albert-base seq 512 compiled,
#    unpadded; the passes below then say which option gives what (each alone, and their parts
#    timed alone). The LAMB stays the recipes' (foreach): compiling LAMB on the GPU outlasted
#    the lamb part's 60 s once, too long a risk for this pass; transject_lamb times it;
#  K kernel_triton: one layer's forward at 8 x 512 / 4096 / 8192 (no grad, compiled, unpadded):
#    softmax, kernel attention (aoglu) as before, and with kernel.inference_backend=triton (its
#    mixing in two fused Triton kernels): the kernel target, kernel >= softmax from N = 4096
#    (0.91x compiled before); the scaling part's figures of that target, the fourth one
#    (second: with targets, one call of 15 minutes measures all four);
#  P profile_targets: bench/profile_step.py on the targets pass's three steps (its options on,
#    compiled; Inductor's cache has their graphs by then): where each step's device time goes
#    now, kernel by kernel, for the next levers;
#  A autotune_gemm: softmax compiled with engine.compile_options.max_autotune_gemm=true (the
#    products autotuned against Inductor's Triton templates with the bias and GELU fused into
#    them; not the pointwise tuning that kept max-autotune-no-cudagraphs from compiling within
#    230 s): the 45% MFU target's lever (GELU and its backward 5.0 ms, LayerNorms 4.9 ms);
#  0t kernel_train_4096, kernel_train_4096_triton: the albert-base training step at 8 x 4096,
#    compiled, unpadded: softmax and kernel attention as before, then kernel attention with
#    model.kernel.training_backend=triton (its mixing after the feature maps as one operator of
#    Triton kernels, forward and backward): what the fused mixing gives a training step where
#    kernel attention is to pass softmax;
#  0m kernel_mixing: the suite's kernelmixing part, the mixing alone, forward and backward,
#    torch operators vs the Triton operator and variants of its backward options (checked
#    against the torch operators first on the GPU) at 8 x 512-8192, softmax's SDPA beside;
#  0 tisa_split: softmax and the TISA step on the split backend (SDPA with the bias detached, so
#    cuDNN stays eligible; f's gradient by its own Triton kernels), compiled, unpadded: does it
#    meet the 1.2x target? and tisasplit: its mixing step alone at the recipe's shape, with
#    other tile sizes / launch options of the kernels (SPLIT_KERNEL_OPTIONS); and objective: the
#    loss terms eager vs compiled (every compiled step now compiles them beside the encoder, so
#    softmax's step here against the 54.6 ms of the last H100 run is their gain, MFU included);
#  0b transject_gj: softmax and TransJect compiled with the Cayley map's leaves by the
#    Gauss-Jordan kernel (model.cayley_leaf_inverse=gauss_jordan; the LU leaves took 5.3 ms of
#    the step, the target lacks 0.7 ms) and the eigen-state's products by three bf16 products
#    each (model.transject.eigen_products=bf16x3; its fp32 products took 7.6 ms), and the
#    cayley and eigenproducts parts: the maps and the leaves alone, LU vs Gauss-Jordan, and the
#    eigen-state alone, fp32 vs bf16x3 (with its errors against fp64);
#  0c norm_output: softmax's albert-base forward + backward compiled, the LayerNorms returning
#    bf16 (model.norm_output: compute, the default since the last GPU run) vs fp32 (what every
#    GPU figure so far ran: torch's autocast rule; 11.9 GB more per step, counted on the CPU);
#    tisa_split's softmax step against the last run's 54.6 ms has both this and the loss terms;
#  1 tisa_flex_dense: softmax and the TISA step on FlexAttention reading the dense (H, N, N)
#    bias (tisa.backend=flex, flex_bias=dense), compiled, unpadded: does it compile now that it
#    asks for two pipeline stages, and does it meet the 1.2x target (SDPA with the bias: 1.40x)?
#  2 transject_lamb: softmax and TransJect compiled with optimizer.implementation=compiled: the
#    0.7 ms the TransJect target (1.51x with the foreach LAMB) lacks (TransJect's process took
#    91 s compiled with the foreach LAMB; compiling the LAMB for its 108 tensors adds about 30 s
#    on the CPU);
#  2b cudagraphs: softmax compiled with engine.compile_mode=reduce-overhead (CUDA graphs: does the
#    engine run under them, and how much of the host gap, 3.3 ms of the 54.6 ms step, goes?);
#  2c pdl: softmax compiled with engine.compile_options.triton.enable_pdl=true (Inductor's
#    kernels launched with programmatic dependent launch, Hopper: each kernel's prologue
#    overlaps the previous one's tail; a torch without the option refuses it at start-up);
#  2d autotune_gemm_others: TISA (split) and TransJect (its three options) compiled with
#    max_autotune_gemm too: Inductor may fuse element-wise work into their products' templates
#    as well (TransJect's scaling by lambda between its two expert products, as a prologue or
#    an epilogue);
#  3 tisa_backends: TISA's mixing step, flex with f from its table or from the dense bias vs
#    SDPA with the bias, 512 to 4096 tokens, gradients checked (tisa.flex_min_length); and the
#    table's gradient by the indexing's scatter vs by diagonal sums (tisabiasgrad);
#  3b profile_4096: the same profile for softmax and kernel attention at 8 x 4096 tokens
#    (albert-base, compiled): kernel attention's step where it is to pass softmax's speed;
#  3c compile_cache: a new process's first compiled step with engine.compile_cache_dir empty
#    and then warm (softmax, TransJect): what a requeued job on another node saves at start;
#  3d compile_scope: engine.compile_scope=layers against the unrolled encoder, cold: the first
#    step (compilation) and the later steps of softmax's recipe and of one shared layer applied
#    48 times (does compiling each layer once cost step time on a GPU?);
#  4 lamb: the LAMB step alone on the recipes' parameters, foreach and compiled;
#  5 compile_check: TransJect's compiled steps finite and equal to eager on the GPU
#    (check_compiled_steps.py, eager / aot_eager / inductor);
#  6 backend_torch: softmax compiled on the engine's torch backend instead of DeepSpeed's
#    ZeRO-0: what DeepSpeed's engine costs a GPU step;
#  7 syncs_compiled: no host sync between logging steps, compiled, for the points not yet checked
#    so (kernel, TransJect, ZeRO-2 softmax);
#  8 large_transject_compiled: TransJect albert-large compiled, finite? its peak at batch 64;
#  9 h100_suite: the eager pretraining table on an H100, every family, albert-base 128 / 512 and
#    albert-large 512, and ZeRO-2.
# A first call (BUDGET 540) runs targets, kernel_triton and profile_targets as far as the budget
# goes (15 minutes of device time, the start included, leave room for one call); a second one
# goes on (ONLY="autotune_gemm kernel_train_4096 kernel_train_4096_triton tisa_split ...").
# What the budget leaves out is named in pending.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu_pending}
BUDGET=${BUDGET:-540}
SUITE=${SUITE:-bench/gpu_suite.sh}
ONLY=${ONLY:-} # pass names to run (a second call: ONLY="compile_check backend_torch"); empty: all
PLAN=${PLAN:-0}
if [ "$PLAN" = 1 ]; then
  LOG=/dev/null # a plan prints, and writes nothing where the results go
else
  mkdir -p "$OUT/passes"
  LOG=$OUT/pending.log
  : >"$LOG"
fi
START=$(date +%s)
SPENT=0 # PLAN=1: the seconds the passes so far would take at their time limits
left() {
  if [ "$PLAN" = 1 ]; then echo $((BUDGET - SPENT)); else echo $((BUDGET - ($(date +%s) - START))); fi
}

pass() { # pass NAME MIN_S LIMIT_S VAR=VALUE...: one run of the suite into $OUT/passes/NAME, its
  # pretrain, syncs and scaling parts limited to LIMIT_S or the budget left, whichever is less
  local name=$1 need=$2 limit=$3
  shift 3
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
  if [ "$(left)" -lt "$need" ]; then
    echo "=== pass $name: skipped, $(left) s left of $BUDGET (needs $need)" | tee -a "$LOG"
    return 0
  fi
  if [ "$(left)" -lt "$limit" ]; then limit=$(left); fi
  echo "=== pass $name ($(left) s left): $*" | tee -a "$LOG"
  if [ "$PLAN" = 1 ]; then
    SPENT=$((SPENT + limit))
    printf '    %s\n' "$@" | tee -a "$LOG" # one setting a line (tests/test_gpu_pending.py reads them)
    echo "=== pass $name: at most $limit s" | tee -a "$LOG"
    return 0
  fi
  env OUT="$OUT/passes/$name" "$@" PRETRAIN_LIMIT="$limit" SYNCS_LIMIT="$limit" SCALING_LIMIT="$limit" \
    PROFILE_LIMIT="$limit" bash "$SUITE" 2>&1 | tee -a "$LOG"
  echo "=== pass $name: done at $(($(date +%s) - START)) s" | tee -a "$LOG"
  tar -czf "$OUT/pending.tgz" -C "$OUT" passes # after every pass: a cut-off call keeps what ran
}

# Only the first pass prints the environment (nvidia-smi, versions): ENV_PART= in the others.
pass targets 240 380 PARTS=pretrain COMPILE=recipe \
  EXTRA="model.tisa.backend=split model.cayley_leaf_inverse=gauss_jordan model.transject.eigen_products=bf16x3 model.transject.residual_stream=compute" \
  "PRETRAIN=--configs albert-base-512 --families softmax tisa transject --padding none --steps 6 --timeout 150"
pass kernel_triton 120 200 ENV_PART= PARTS=scaling \
  "SCALING=--no-mask --compile --families softmax kernel kernel-triton --lengths 512 4096 8192"
pass profile_targets 150 220 ENV_PART= PARTS=profile \
  "PROFILE=--families softmax tisa transject --padding none --steps 3 --warmup 2 --override engine.compile=true model.tisa.backend=split model.cayley_leaf_inverse=gauss_jordan model.transject.eigen_products=bf16x3 model.transject.residual_stream=compute"
pass autotune_gemm 150 260 ENV_PART= PARTS=pretrain COMPILE=recipe EXTRA=engine.compile_options.max_autotune_gemm=true \
  "PRETRAIN=--configs albert-base-512 --families softmax --padding none --steps 6 --timeout 250"
pass kernel_train_4096 150 230 ENV_PART= PARTS=pretrain COMPILE=recipe EXTRA=model.max_position_embeddings=4096 \
  "PRETRAIN=--configs albert-base-512 --families softmax kernel --seq 4096 --batch 8 --padding none --steps 6 --timeout 110"
pass kernel_train_4096_triton 120 150 ENV_PART= PARTS=pretrain COMPILE=recipe \
  EXTRA="model.max_position_embeddings=4096 model.kernel.training_backend=triton" \
  "PRETRAIN=--configs albert-base-512 --families kernel --seq 4096 --batch 8 --padding none --steps 6 --timeout 140"
pass kernel_mixing 120 180 ENV_PART= PARTS=kernelmixing
pass tisa_split 150 250 ENV_PART= PARTS="pretrain tisasplit objective" COMPILE=recipe EXTRA="model.tisa.backend=split" \
  "PRETRAIN=--configs albert-base-512 --families softmax tisa --padding none --steps 6 --timeout 115"
pass transject_gj 200 300 ENV_PART= PARTS="pretrain cayley eigenproducts" COMPILE=recipe \
  EXTRA="model.cayley_leaf_inverse=gauss_jordan model.transject.eigen_products=bf16x3" \
  "PRETRAIN=--configs albert-base-512 --families softmax transject --padding none --steps 6 --timeout 170"
pass norm_output 120 160 ENV_PART= PARTS=normoutput
pass tisa_flex_dense 150 250 ENV_PART= PARTS=pretrain COMPILE=recipe \
  EXTRA="model.tisa.backend=flex model.tisa.flex_bias=dense" \
  "PRETRAIN=--configs albert-base-512 --families softmax tisa --padding none --steps 6 --timeout 115"
pass transject_lamb 200 300 ENV_PART= PARTS=pretrain COMPILE=recipe LAMB=compiled \
  "PRETRAIN=--configs albert-base-512 --families softmax transject --padding none --steps 6 --timeout 170"
pass cudagraphs 120 170 ENV_PART= PARTS=pretrain COMPILE=recipe EXTRA=engine.compile_mode=reduce-overhead \
  "PRETRAIN=--configs albert-base-512 --families softmax --padding none --steps 6 --timeout 160"
pass pdl 120 170 ENV_PART= PARTS=pretrain COMPILE=recipe EXTRA=engine.compile_options.triton.enable_pdl=true \
  "PRETRAIN=--configs albert-base-512 --families softmax --padding none --steps 6 --timeout 160"
pass autotune_gemm_others 200 330 ENV_PART= PARTS=pretrain COMPILE=recipe \
  EXTRA="engine.compile_options.max_autotune_gemm=true model.tisa.backend=split model.cayley_leaf_inverse=gauss_jordan model.transject.eigen_products=bf16x3 model.transject.residual_stream=compute" \
  "PRETRAIN=--configs albert-base-512 --families tisa transject --padding none --steps 6 --timeout 160"
pass tisa_backends 100 200 ENV_PART= PARTS="tisabackends tisabiasgrad"
pass profile_4096 150 220 ENV_PART= PARTS=profile \
  "PROFILE=--families softmax kernel --seq 4096 --batch 8 --padding none --steps 3 --warmup 2 --override engine.compile=true model.max_position_embeddings=4096"
pass compile_cache 200 250 ENV_PART= PARTS=compilecache
pass compile_scope 250 320 ENV_PART= PARTS=compilescope
pass lamb 100 160 ENV_PART= PARTS=lamb
pass compile_check 150 360 ENV_PART= PARTS=compilecheck
pass backend_torch 90 120 ENV_PART= PARTS=pretrain COMPILE=recipe EXTRA=engine.backend=torch \
  "PRETRAIN=--configs albert-base-512 --families softmax --padding none --steps 6 --timeout 110"
pass syncs_compiled 120 200 ENV_PART= PARTS=syncs COMPILE=recipe \
  "SYNCS=--points zero0:kernel zero0:transject zero2:softmax"
pass large_transject_compiled 150 200 ENV_PART= PARTS=pretrain COMPILE=recipe \
  "PRETRAIN=--configs albert-large-512 --families transject --steps 4 --warmup 3 --timeout 190"
pass h100_suite 150 240 ENV_PART= PARTS="pretrain pretrain2"
if [ "$PLAN" = 1 ]; then
  echo "=== plan: at most $SPENT s of the $BUDGET s budget" | tee -a "$LOG"
  exit 0
fi
echo "=== all passes done in $(($(date +%s) - START)) s" | tee -a "$LOG"
tar -czf "$OUT/pending.tgz" -C "$OUT" passes && rm -rf "$OUT/passes"
ls -la "$OUT" | tee -a "$LOG"
