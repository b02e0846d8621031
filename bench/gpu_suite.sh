#!/usr/bin/env bash
# The GPU half of the benchmark suite, in ONE call on a GPU machine (an H100: < 9 min wall).
#
#   bash bench/gpu_suite.sh             # full suite -> $OUT/*.json + $OUT/suite.log
#   SMOKE=1 bash bench/gpu_suite.sh     # every part at a tiny size (~4 min): checks the setup
#   PARTS="model depth" bash bench/gpu_suite.sh     # only those parts
#   LAMB=torch bash bench/gpu_suite.sh  # another LAMB: torch (pytorch_optimizer, the reference)
#                                       # or deepspeed (FusedLamb, JIT-built first; ZeRO-0 parts
#                                       # only); default: the recipes' own (auto = foreach)
#   EXTRA="engine.compile=true" bash bench/gpu_suite.sh   # extra recipe overrides (engine parts)
#   COMPILE=recipe bash bench/gpu_suite.sh   # engine.compile as the recipes set it (default: off)
#   PRETRAIN="--accumulation 8 --padding none" bash bench/gpu_suite.sh  # pretrain part's options
#   SCALING="--no-mask" bash bench/gpu_suite.sh   # scaling part without a mask (unpadded path)
#   SCALING="--no-mask --compile --families softmax kernel --lengths 4096 8192" SCALING_LIMIT=150 \
#     PARTS=scaling bash bench/gpu_suite.sh       # compiled, as the recipes ship (a compile per point)
#   PRETRAIN_LIMIT=180 bash bench/gpu_suite.sh  # the pretrain part's time limit (default 210 s)
#   PROFILE="--override engine.compile=true" bash bench/gpu_suite.sh  # the profile part's options
#   PROFILE_LIMIT=200 bash bench/gpu_suite.sh   # the profile part's time limit (default 120 s)
#   ENV_PART= PARTS=pretrain bash bench/gpu_suite.sh  # without the env part (a second pass)
#
# Run it from the repository root of a checkout installed with `pip install -e .` over a CUDA
# build of torch. Without $OUT the results go to bench/results/gpu/. The GPU's correctness checks
# are tests: python -m pytest -m gpu.
#
# Parts (each under its own time limit, so one that hangs cannot eat the others' time):
#   model     bench_model: ours vs HF ALBERT, albert-base (12 layers), batch 32, seq 128/512,
#             bf16 autocast                                              -> model_gpu.json
#   scaling   bench_attention_scaling: one layer, d=768, H=12, batch 8, N = 256 .. 16384,
#             every family, bf16 autocast, forward                     -> scaling_gpu.json
#   pretrain  bench_pretrain_throughput: the shipped recipe (DeepSpeed ZeRO-0, bf16-mixed,
#             LAMB foreach), albert-base seq 128 / 512 and albert-large seq 512, micro-batch 64,
#             every family; "opt share" = the optimizer step's share of the step
#                                                                      -> pretrain_gpu.json
#   pretrain2 the same on ZeRO-2 (flat partitions, LAMB per tensor on them), softmax,
#             albert-base seq 512                                 -> pretrain_zero2_gpu.json
#   depth     the same at albert-base width with 12/24/48/96 shared layers, activation
#             checkpointing, seq 512, batch 32, softmax               -> depth_gpu.json
#   loader    bench_loader: loader alone vs the real trainer (python -m pretrain), albert-base
#             seq 128 (num_workers 0 and 4) and 512 (4): data-wait share -> loader_gpu.json
#   cayley    bench_fast_paths cayley: TransJect's 121 orthogonal maps at d = 768 (albert-base),
#             forward + backward, by block inverse (the default) vs the LU solve vs torch's own
#             parametrization, with their errors; then a 12-layer TransJect pretraining step,
#             seq 512, batch 16, bf16, block vs LU                       -> cayley_gpu.json
#   lamb      bench_lamb: the LAMB step alone on albert-base's, albert-base-transject's and
#             albert-large-transject's parameters: ours as the engine runs it (a step that may
#             be skipped on the device), ours plain, pytorch_optimizer's LAMB     -> lamb_gpu.json
#   profile   profile_step: softmax and TransJect's albert-base recipes, seq 512, batch 64, eager
#             (PROFILE="--override engine.compile=true": compiled), 3 steps under torch.profiler:
#             each operator's device time per step and the share of each kind of work (not in
#             the default PARTS)                                        -> profile_gpu.json
#   tisabackends  bench_fast_paths tisa-backends: TISA flex (f from its table, and from the
#             dense (H, N, N) bias: tisa.flex_bias) and split vs SDPA bias per length, softmax's
#             SDPA beside, the length from which flex wins (tisa.flex_min_length)
#                                                                     -> tisa_backends_gpu.json
#   tisasplit the same at the recipe's shape (batch 64, 512 tokens), the split backend's Triton
#             kernels with several tile sizes / launch options         -> tisa_split_gpu.json
#   objective bench_fast_paths objective: the pretraining loss terms on the MLM logits of
#             albert-base at seq 512 (64 x 77 slots x 30000), eager vs compiled as the trainer
#             compiles them beside the encoder, and the bytes each moves -> objective_gpu.json
#   normoutput  bench_fast_paths norm-output: softmax's albert-base forward + backward at the
#             recipe's shape, compiled, the LayerNorms returning bf16 (model.norm_output: compute,
#             the default) vs fp32 (torch's autocast rule)              -> norm_output_gpu.json
#   kernelmixing  bench_fast_paths kernel-mixing: kernel attention's mixing alone (after the
#             feature maps), forward + backward, 8 x 512-8192, albert-base width: the torch
#             operators eager and compiled vs the Triton operator (kernel.training_backend) and
#             variants of its backward kernels' options, softmax's SDPA beside; checked against
#             the torch path first                                     -> kernel_mixing_gpu.json
#   compilecache  bench_compile_cache: the first step of a new process compiled with
#             engine.compile_cache_dir empty (cold) and then holding the first process's
#             graphs (warm), softmax and TransJect's albert-base recipes at seq 512 (not in the
#             default PARTS)                                           -> compile_cache_gpu.json
#   compilescope  bench_compile_scope: engine.compile_scope=layers (each distinct layer
#             compiled once) vs encoder (the unrolled encoder, the default), every run cold:
#             the first step and later steps, softmax's albert-base recipe at seq 512 and one
#             shared layer applied 48 times (not in the default PARTS) -> compile_scope_gpu.json
#   eigenproducts  bench_fast_paths eigen-products: TransJect's eigen-state at the recipe's
#             shape (64 x 512, d = 768), its products in fp32 vs three bf16 products each
#             (transject.eigen_products), errors against fp64 and times -> eigen_products_gpu.json
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
LOG=$OUT/suite.log
: >"$LOG"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
SMOKE=${SMOKE:-0}
PARTS=${PARTS:-jit cayley lamb model scaling pretrain pretrain2 depth loader tisa tisabackends tisasplit objective normoutput kernelmixing eigenproducts orthocache}
# LAMB=auto: what a recipe picks by itself, the foreach LAMB (engine/lamb.py: per tensor on every
# ZeRO stage 0-2, no host synchronisation, nothing to build). LAMB=torch: pytorch_optimizer.Lamb.
# LAMB=deepspeed: DeepSpeed's FusedLamb, JIT-built by the `jit` part first (ZeRO-0 only: the
# engine refuses it on ZeRO-2's flat buffers, so pretrain2 keeps the foreach LAMB then).
LAMB=${LAMB:-auto}
# EXTRA: more recipe overrides for the engine parts (pretrain, depth, loader), e.g.
# EXTRA="engine.compile=true" (then budget the compile time: warm-up steps absorb it).
read -ra EXTRA_OVERRIDES <<<"${EXTRA:-}"
# COMPILE: engine.compile for the engine parts. false (the default): eager for every family, so
# the parts fit their limits (a compile costs up to about 85 s per family and process); true; or recipe:
# each recipe's own (auto: on a GPU, every shipped family). EXTRA overrides it.
COMPILE=${COMPILE:-false}
if [ "$COMPILE" != recipe ]; then EXTRA_OVERRIDES=("engine.compile=$COMPILE" "${EXTRA_OVERRIDES[@]}"); fi
read -ra PRETRAIN_ARGS <<<"${PRETRAIN:-}"  # e.g. PRETRAIN="--accumulation 8 --padding none"
read -ra SCALING_ARGS <<<"${SCALING:-}"  # e.g. SCALING="--no-mask" (the unpadded path)
read -ra PROFILE_ARGS <<<"${PROFILE:-}"  # e.g. PROFILE="--override engine.compile=true"
OVERRIDES=("${EXTRA_OVERRIDES[@]}")
# OPT2: EXTRA alone (the recipes' own LAMB), for ZeRO-2, where the engine refuses FusedLamb.
if [ ${#OVERRIDES[@]} -gt 0 ]; then OPT2=(--override "${OVERRIDES[@]}"); else OPT2=(); fi
if [ "$LAMB" != auto ]; then OVERRIDES=("optimizer.implementation=$LAMB" "${OVERRIDES[@]}"); fi
if [ ${#OVERRIDES[@]} -gt 0 ]; then OPT=(--override "${OVERRIDES[@]}"); else OPT=(); fi
if [ "$LAMB" = torch ]; then OPT2=("${OPT[@]}"); fi # the reference LAMB runs on ZeRO-2 too
START=$(date +%s)

part() { # part NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  case " ${ENV_PART-env} $PARTS " in *" $name "*) ;; *) return 0 ;; esac
  local t0
  t0=$(date +%s)
  echo "=== $name (limit ${limit} s): $*" | tee -a "$LOG"
  timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $(($(date +%s) - t0)) s (suite at $(($(date +%s) - START)) s)" |
    tee -a "$LOG"
}

# Some CUDA images set TORCH_CUDA_ARCH_LIST to a value DeepSpeed's JIT builder cannot parse (an arch
# with a letter suffix such as 9.0a: "invalid literal for int() with base 10: '0a'"); use the
# GPU's own compute capability instead.
echo "TORCH_CUDA_ARCH_LIST was '${TORCH_CUDA_ARCH_LIST-unset}'" | tee -a "$LOG"
TORCH_CUDA_ARCH_LIST=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)
export TORCH_CUDA_ARCH_LIST
echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST; LAMB=$LAMB; COMPILE=$COMPILE; EXTRA=${EXTRA:-}; SMOKE=$SMOKE; PARTS=$PARTS" |
  tee -a "$LOG"

part env 40 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv;
  nvcc --version | tail -2; python3 -c "
import sys, torch, transformers, triton, deepspeed, omegaconf, pydantic
print(sys.version.split()[0], \"torch\", torch.__version__, \"cuda\", torch.version.cuda,
      \"transformers\", transformers.__version__, \"triton\", triton.__version__,
      \"deepspeed\", deepspeed.__version__, \"omegaconf\", omegaconf.__version__,
      \"pydantic\", pydantic.__version__)
import engine.engine, model, pretrain.train, data_prep.loader
print(\"imports ok:\", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
"'

# DeepSpeed's fused optimizers are JIT-built (ninja + nvcc) on first use; build them here, timed,
# so that a pretraining point does not pay for it (LAMB=auto) and a failure shows up once.
JIT_PY="
import sys, time
from deepspeed.ops import op_builder
for b in [getattr(op_builder, name)() for name in sys.argv[1:]]:
    t = time.time()
    try:
        b.load(verbose=False)
        print(b.name, 'built and loaded in', round(time.time() - t, 1), 's', flush=True)
    except Exception as e:
        print(b.name, 'FAILED after', round(time.time() - t, 1), 's:', repr(e)[-1500:], flush=True)
"
if [ "$LAMB" = deepspeed ]; then
  part jit 80 python3 -c "$JIT_PY" FusedLambBuilder  # ~40 s on an H100
elif [ "$SMOKE" = 1 ]; then # only a check: in the background, beside the other parts
  (case " $PARTS " in *" jit "*) timeout 240 python3 -c "$JIT_PY" FusedLambBuilder FusedAdamBuilder >"$OUT/jit.log" 2>&1 ;; esac) &
fi

if [ "$SMOKE" = 1 ]; then
  part cayley 40 python3 -m bench.bench_fast_paths cayley --device cuda --dtype bf16 --hidden 256 \
    --heads 4 --maps 11 --layers 2 --seq 128 --batch 4 --warmup 1 --repeats 3 \
    --out "$OUT/cayley_gpu.json"
  part pretrain 150 python3 -m bench.bench_pretrain_throughput --device cuda \
    --configs albert-base-128 --steps 3 --warmup 2 --timeout 75 "${OPT[@]}" \
    --out "$OUT/pretrain_gpu.json"
  part pretrain2 60 python3 -m bench.bench_pretrain_throughput --device cuda --zero-stage 2 \
    --families softmax --configs albert-base-128 --steps 3 --warmup 2 --timeout 50 \
    "${OPT2[@]}" --out "$OUT/pretrain_zero2_gpu.json"
  part model 45 python3 -m bench.bench_model --device cuda --dtype bf16 --layers 2 --batch 8 \
    --seq 128 --repeats 3 --warmup 1 --out "$OUT/model_gpu.json"
  part scaling 70 python3 -m bench.bench_attention_scaling --device cuda --dtype bf16 \
    --width 768 --heads 12 --batch 8 --lengths 256 4096 --repeats 3 --warmup 2 \
    --out "$OUT/scaling_gpu.json"
  part depth 45 python3 -m bench.bench_pretrain_throughput --device cuda --depth 12 48 \
    --steps 2 --warmup 1 "${OPT[@]}" --out "$OUT/depth_gpu.json"
  part loader 60 python3 -m bench.bench_loader --device cuda --runs albert-base-128:2 \
    --steps 12 --log-every 4 --batches 10 "${OPT[@]}" --out "$OUT/loader_gpu.json"
  wait
  if [ -f "$OUT/jit.log" ]; then
    echo "=== jit (background)" | tee -a "$LOG"
    tee -a "$LOG" <"$OUT/jit.log"
  fi
else
  # The orthogonal maps by block inverse vs LU: most of a TransJect step on one GPU before.
  part cayley 60 python3 -m bench.bench_fast_paths cayley --device cuda --dtype bf16 --hidden 768 \
    --heads 12 --maps 121 --layers 12 --seq 512 --batch 16 --warmup 2 --repeats 10 \
    --out "$OUT/cayley_gpu.json"
  part model 60 python3 -m bench.bench_model --device cuda --dtype bf16 --layers 12 --batch 32 \
    --seq 128 512 --repeats 20 --warmup 3 --out "$OUT/model_gpu.json"
  part scaling "${SCALING_LIMIT:-80}" python3 -m bench.bench_attention_scaling --device cuda --dtype bf16 \
    --width 768 --heads 12 --batch 8 --lengths 256 512 1024 2048 4096 8192 16384 \
    --repeats 10 --warmup 3 "${SCALING_ARGS[@]}" --out "$OUT/scaling_gpu.json"
  part pretrain "${PRETRAIN_LIMIT:-210}" python3 -m bench.bench_pretrain_throughput --device cuda --preset albert \
    --steps 8 --warmup 3 --timeout 75 "${PRETRAIN_ARGS[@]}" "${OPT[@]}" --out "$OUT/pretrain_gpu.json"
  # The other shipped engine setting: ZeRO-2 (flat partitions; the LAMB per tensor on them).
  part pretrain2 60 python3 -m bench.bench_pretrain_throughput --device cuda --zero-stage 2 \
    --families softmax --configs albert-base-512 --steps 8 --warmup 3 --timeout 55 \
    "${OPT2[@]}" --out "$OUT/pretrain_zero2_gpu.json"
  part depth 50 python3 -m bench.bench_pretrain_throughput --device cuda --depth 12 24 48 96 \
    --steps 4 --warmup 2 --timeout 45 "${OPT[@]}" --out "$OUT/depth_gpu.json"
  part loader 85 python3 -m bench.bench_loader --device cuda \
    --runs albert-base-128:0 albert-base-128:4 albert-base-512:4 --steps 20 --log-every 5 \
    "${OPT[@]}" --out "$OUT/loader_gpu.json"
  # TISA through FlexAttention at one length in a fresh process (compiled once, static shapes):
  # tests whether the slowdown of the scaling / pretrain parts comes from their dynamic-shape
  # recompile at a second length (docs/benchmarks.md#attention-scaling).
  part tisa 60 python3 -m bench.bench_fast_paths tisa --device cuda --dtype bf16 --hidden 768 \
    --heads 12 --layers 12 --batch 32 --seq 512 --warmup 3 --repeats 10 --out "$OUT/tisa_gpu.json"
  # TISA's mixing step, FlexAttention vs SDPA with the bias, per length: sets tisa.flex_min_length.
  part tisabackends 120 python3 -m bench.bench_fast_paths tisa-backends --device cuda --dtype bf16 \
    --hidden 768 --heads 12 --batch 8 --seq 512 1024 2048 4096 --warmup 3 --repeats 5 \
    --out "$OUT/tisa_backends_gpu.json"
  # TISA's split backend at the recipe's shape (micro-batch 64, 512 tokens) beside SDPA with the
  # bias and softmax's SDPA, with other tile sizes / launch options of its Triton kernels.
  part tisasplit 120 python3 -m bench.bench_fast_paths tisa-backends --device cuda --dtype bf16 \
    --hidden 768 --heads 12 --batch 64 --seq 512 --warmup 3 --repeats 10 --no-flex \
    --split-options 64:4:2 128:8:2 64:8:3 32:4:2 --out "$OUT/tisa_split_gpu.json"
  # The pretraining loss terms, eager vs compiled (what engine.compile adds beside the encoder).
  part objective 60 python3 -m bench.bench_fast_paths objective --device cuda --batch 64 \
    --vocab 30000 --warmup 3 --repeats 10 --out "$OUT/objective_gpu.json"
  # Kernel attention's training mixing alone: the torch operators vs the Triton operator.
  part kernelmixing 170 python3 -m bench.bench_fast_paths kernel-mixing --device cuda --dtype bf16 \
    --hidden 768 --heads 12 --batch 8 --seq 512 2048 4096 8192 --warmup 3 --repeats 10 \
    --mixing-options 64:4:2 64:8:3 32:8:2 --out "$OUT/kernel_mixing_gpu.json"
  # The LayerNorms' output under autocast: bf16 (the default) vs fp32, softmax compiled.
  part normoutput 150 python3 -m bench.bench_fast_paths norm-output --device cuda --families softmax \
    --hidden 768 --heads 12 --layers 12 --batch 64 --seq 512 --vocab 30000 --compiled \
    --warmup 3 --repeats 10 --out "$OUT/norm_output_gpu.json"
  # TransJect's eigen-state: fp32 products vs three bf16 products each (tensor cores), errors too.
  part eigenproducts 60 python3 -m bench.bench_fast_paths eigen-products --device cuda --hidden 768 \
    --heads 12 --batch 64 --seq 512 --warmup 3 --repeats 10 --out "$OUT/eigen_products_gpu.json"
  # TransJect inference with its orthogonal maps kept across forwards vs evaluated every time.
  part orthocache 40 python3 -m bench.bench_fast_paths orthogonal-cache --device cuda --dtype bf16 \
    --hidden 768 --heads 12 --layers 1 --batch 8 --seq 256 4096 16384 --warmup 2 --repeats 10 \
    --out "$OUT/orthogonal_cache_gpu.json"
  # The LAMB step alone on the recipes' parameters: ours as the engine runs it, ours plain, and
  # pytorch_optimizer's reference (per tensor, a host sync per trust ratio).
  part lamb 150 python3 -m bench.bench_lamb --device cuda --recipe albert-base \
    albert-base-transject albert-large-transject --out "$OUT/lamb_gpu.json"
  # Where a step's time goes, per operator (torch.profiler), softmax and TransJect at albert-base
  # seq 512: which kind of work holds TransJect's gap to softmax.
  part profile "${PROFILE_LIMIT:-120}" python3 -m bench.profile_step --device cuda --families softmax transject \
    "${PROFILE_ARGS[@]}" --out "$OUT/profile_gpu.json"
  # The compiler's cache across processes: a new process's first step, cold vs warm.
  part compilecache 230 python3 -m bench.bench_compile_cache --device cuda --families softmax transject \
    --config albert-base-512 --steps 3 --timeout 150 --out "$OUT/compile_cache_gpu.json"
  # Compiling each distinct layer once vs the unrolled encoder: compile time and step time.
  part compilescope 300 python3 -m bench.bench_compile_scope --device cuda --families softmax \
    --depth 48 --steps 4 --timeout 200 --out "$OUT/compile_scope_gpu.json"
fi
echo "=== suite done in $(($(date +%s) - START)) s; files in $OUT:" | tee -a "$LOG"
ls -la "$OUT" | tee -a "$LOG"
