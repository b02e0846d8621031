"""The fast paths, measured: TISA's overhead over softmax, torch.compile's gain, length
grouping for fine-tuning, the padding share of pretraining batches; on GPU also FlexAttention vs
the SDPA bias and apex's fused LayerNorm vs torch's, with equality checks.

Every timing is the median of `--repeats` interleaved forward + backward steps after `--warmup`
untimed ones (CUDA: synchronised). Ratios compare two paths in the same process.

    python bench/bench_fast_paths.py tisa --seq 128 512 --out tisa_cpu.json
    python bench/bench_fast_paths.py compile --families softmax kernel --out compile_cpu.json
    python bench/bench_fast_paths.py grouping --out grouping_cpu.json
    python bench/bench_fast_paths.py pretrain-padding
    python bench/bench_fast_paths.py orthogonal-cache --seq 256 1024 4096 --batch 1
    python bench/bench_fast_paths.py orthogonal-step --seq 128 --batch 4 --accumulation 4
    python bench/bench_fast_paths.py orthogonal-shard --ranks 2 --seq 128 --batch 4 --accumulation 1
    python bench/bench_fast_paths.py cayley --hidden 768 --maps 121 --layers 2 --seq 128 --batch 4
    python bench/bench_fast_paths.py transject-experts --hidden 768 --heads 12 --layers 2 --seq 128
    python bench/bench_fast_paths.py gpu-verify            # CUDA: flex, compile, apex; asserts
    python bench/bench_fast_paths.py tisa-backends --device cuda --dtype bf16 --seq 256 512 1024 2048 4096
    python bench/bench_fast_paths.py attention-checks      # CUDA: masks, bf16 kernel, maps; asserts
    python bench/bench_fast_paths.py tisa-bias-grad --heads 12 --seq 512 1024  # the bias's gradient
    python bench/bench_fast_paths.py objective --batch 16 --vocab 30000   # the loss terms compiled
    python bench/bench_fast_paths.py eigen-products --hidden 768 --heads 12 --batch 4 --seq 512
    python bench/bench_fast_paths.py norm-output --families softmax --seq 128 --compiled  # LN's dtype
    python bench/bench_fast_paths.py kernel-mixing --device cuda --dtype bf16 --hidden 768 --heads 12 --seq 512 4096

`gpu-verify` checks on CUDA (and fails loudly otherwise): TISA flex == SDPA bias in forward and
in every gradient (fp32 and bf16 autocast) and that training steps do not recompile; the
inductor-compiled encoder of every family == eager (loss and gradients); apex's LayerNorm ==
torch's when NVIDIA apex is importable. Then it times flex vs SDPA bias, compiled vs eager and
apex vs torch LayerNorm.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import EncoderConfig, EncoderForPretraining, EncoderForSequenceClassification

FAMILY_OVERRIDES = {
    "softmax": {},
    "tisa": {"position_embedding": "none"},
    "kernel": {"kernel": {"feature_map": "aoglu", "dropout": 0.0}},
    "transject": {"transject": {"num_experts": 4}},
}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(fns: dict, warmup: int, repeats: int, device: str) -> dict[str, float]:
    """Median seconds per call of each fn, interleaved (a, b, a, b, ...)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def model_config(family: str, args, **extra) -> EncoderConfig:
    return EncoderConfig.preset(
        "debug",
        attention=family,
        vocab_size=args.vocab,
        embedding_size=128,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        max_position_embeddings=max(512, max(getattr(args, "seq", [512]))),
        hidden_dropout_prob=0.0,
        **{**FAMILY_OVERRIDES[family], **extra},
    )


def pretraining_step(model, ids, mask, autocast):
    def step():
        model.zero_grad(set_to_none=True)
        with autocast():
            out = model(ids, mask, masked_positions=mask & (ids % 7 == 0))
            loss = out.logits.float().logsumexp(-1).mean() + out.sop_logits.float().sum()
            loss = loss + sum(out.aux_losses.values(), torch.zeros((), device=ids.device))
        loss.backward()

    return step


def orthogonal_matrix_count(model) -> int:
    """How many matrices the model's fp32-orthogonal maps produce (a batch of E counts E)."""
    from model.orthogonal import orthogonal_modules

    return sum(
        m.parametrizations[n].original.shape[:-2].numel() for _, m, n in orthogonal_modules(model)
    )


def make_batch(args, N: int, device: str, padded: bool = True):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, args.vocab, (args.batch, N), generator=g)
    mask = torch.ones(args.batch, N, dtype=torch.bool)
    if padded:  # a quarter of the rows padded to half length
        mask[: args.batch // 4, N // 2 :] = False
    return ids.to(device), mask.to(device)


def autocast_for(args):
    if args.dtype == "bf16":
        return lambda: torch.autocast(args.device, dtype=torch.bfloat16)
    return contextlib.nullcontext


def tisa_mixing(backend: str, q, k, v, values, mask, dtype):
    """TISA's attention output on one path: `flex` (f from its table), `flex_dense` (f from the
    (H, N, N) bias, `tisa.flex_bias: dense`), `sdpa` (the materialised bias + key padding),
    `split` (that bias detached, f's gradient by the Triton kernels; `split:BLOCK:WARPS:STAGES`
    with other kernel options than `SPLIT_KERNEL_OPTIONS`), or `softmax` (no f at all: SDPA
    with the key padding as a boolean mask, the peer the TISA target is measured against)."""
    from model.attention.tisa import flex_dense_bias, sdpa_bias, tisa_flex_attention
    from model.attention.tisa_split import split_attention

    if backend == "flex":
        return tisa_flex_attention(q, k, v, values, mask)
    if backend == "flex_dense":
        return tisa_flex_attention(q, k, v, values, mask, dense_bias_HNN=flex_dense_bias(values))
    if backend == "softmax":
        keys = None if mask is None else mask[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keys)
    if backend.startswith("split"):  # the kernel options: `split_kernel_options(backend)`
        return split_attention(q, k, v, values, sdpa_bias(values.detach(), mask, dtype), mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_bias(values, mask, dtype))


@contextlib.contextmanager
def kernel_options(options: dict, variant: str, block_key: str):
    """`name:BLOCK:WARPS:STAGES` -> those tile and launch options in the `options` dict of a
    module's Triton kernels while the block runs (run the backward inside it too); a name
    without them: the shipped options."""
    shipped = dict(options)
    if variant.count(":") == 3:
        block, warps, stages = (int(x) for x in variant.split(":")[1:])
        options.update({block_key: block, "num_warps": warps, "num_stages": stages})
    try:
        yield
    finally:
        options.update(shipped)


def split_kernel_options(backend: str):
    """`split:BLOCK:WARPS:STAGES` -> those `SPLIT_KERNEL_OPTIONS` while the block runs."""
    from model.attention import tisa_split

    return kernel_options(tisa_split.SPLIT_KERNEL_OPTIONS, backend, "BLOCK")


def first_line(error: Exception) -> str:
    """An exception's message, its first line (Inductor's run to many)."""
    return str(error).strip().splitlines()[0]


# ----------------------------------------------------------------------------- tisa


def bench_tisa(args) -> dict:
    """Step time of TISA (sdpa bias; flex too on CUDA) over plain softmax, same sizes."""
    rows = []
    for N in args.seq:
        ids, mask = make_batch(args, N, args.device)
        fns = {}
        for name, family, extra in (
            ("softmax", "softmax", {}),
            ("tisa_sdpa", "tisa", {"tisa": {"backend": "sdpa"}}),
            *(
                (("tisa_flex", "tisa", {"tisa": {"backend": "flex"}}),)
                if args.device == "cuda"
                else ()
            ),
        ):
            torch.manual_seed(0)
            model = EncoderForPretraining(model_config(family, args, **extra)).to(args.device)
            fns[name] = pretraining_step(model, ids, mask, autocast_for(args))
        t = time_steps(fns, args.warmup, args.repeats, args.device)
        row = {"seq": N, **{f"{k}_s": v for k, v in t.items()}}
        row["tisa_sdpa_over_softmax"] = t["tisa_sdpa"] / t["softmax"]
        if "tisa_flex" in t:
            row["tisa_flex_over_softmax"] = t["tisa_flex"] / t["softmax"]
        rows.append(row)
        print(json.dumps(row))
    return {"rows": rows}


# ----------------------------------------------------------------------------- compile


def bench_compile(args) -> dict:
    """torch.compile (inductor) of the encoder vs eager, per family: compile time, step time."""
    from engine.engine import compile_encoder

    rows = []
    N = args.seq[0]
    ids, mask = make_batch(args, N, args.device)
    for family in args.families:
        torch.manual_seed(0)
        eager = EncoderForPretraining(model_config(family, args)).to(args.device)
        torch.manual_seed(0)
        compiled = EncoderForPretraining(model_config(family, args)).to(args.device)
        compile_encoder(compiled, args.compile_backend)
        start = time.perf_counter()
        pretraining_step(compiled, ids, mask, autocast_for(args))()
        sync(args.device)
        compile_s = time.perf_counter() - start
        fns = {
            "eager": pretraining_step(eager, ids, mask, autocast_for(args)),
            "compiled": pretraining_step(compiled, ids, mask, autocast_for(args)),
        }
        t = time_steps(fns, args.warmup, args.repeats, args.device)
        row = {
            "family": family,
            "seq": N,
            "first_step_s": compile_s,
            "eager_s": t["eager"],
            "compiled_s": t["compiled"],
            "speedup": t["eager"] / t["compiled"],
        }
        rows.append(row)
        print(json.dumps(row))
        torch._dynamo.reset()
    return {"rows": rows}


# ----------------------------------------------------------------------------- grouping


def glue_like_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Long-tailed lengths like GLUE's (SST-2/MNLI/QQP: median ~25 tokens, tail to 128)."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=3.2, sigma=0.55, size=n).astype(np.int64), 4, 128)


def bench_grouping(args) -> dict:
    """One fine-tuning epoch (forward, backward, AdamW) with the default shuffled batches vs
    group_by_length batches: padding share computed and time per epoch."""
    from torch.utils.data import DistributedSampler

    from finetune.batching import LengthGroupedBatchSampler, collate

    lengths = glue_like_lengths(args.examples)
    rng = np.random.default_rng(1)
    data = [
        {
            "input_ids": rng.integers(5, args.vocab, n).tolist(),
            "token_type_ids": [0] * n,
            "label": 0,
        }
        for n in lengths
    ]
    B = args.batch
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True)
    shuffled = list(sampler)
    plans = {
        "shuffled": [shuffled[i : i + B] for i in range(0, len(shuffled) - B + 1, B)],
        "grouped": list(LengthGroupedBatchSampler(lengths, B, seed=0)),
    }
    out = {"examples": args.examples, "batch": B, "median_length": float(np.median(lengths))}
    for name, plan in plans.items():
        batches = [collate([data[i] for i in idx], pad_id=0) for idx in plan]
        computed = sum(b["attention_mask"].numel() for b in batches)
        real = sum(int(b["attention_mask"].sum()) for b in batches)
        torch.manual_seed(0)
        cfg = model_config("softmax", argparse.Namespace(**{**vars(args), "seq": [128]}))
        model = EncoderForSequenceClassification(cfg).to(args.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def epoch(model=model, opt=opt, batches=batches):
            for b in batches:
                logits = model(
                    b["input_ids"].to(args.device), b["attention_mask"].to(args.device)
                ).logits
                F.cross_entropy(logits.float(), b["labels"].to(args.device)).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

        epoch()  # warm-up
        times = []
        for _ in range(args.repeats):
            sync(args.device)
            start = time.perf_counter()
            epoch()
            sync(args.device)
            times.append(time.perf_counter() - start)
        out[name] = {
            "batches": len(batches),
            "padding_share": 1 - real / computed,
            "tokens_computed": computed,
            "epoch_s": statistics.median(times),
        }
        print(name, json.dumps(out[name]))
    out["epoch_speedup"] = out["shuffled"]["epoch_s"] / out["grouped"]["epoch_s"]
    print("speedup", out["epoch_speedup"])
    return out


# ----------------------------------------------------------------------------- pretraining


def bench_pretrain_padding(args) -> dict:
    """Padding share of pretraining batches: ALBERT example construction (data_prep.shards.
    build_examples, short_seq_prob 0.1) on synthetic documents, random batches padded to the
    batch's longest (the loader's default) or to max_seq_length (static shapes)."""
    from bench_length_grouping import synthetic_lengths  # bench/ (this script's folder)

    rows = []
    for doc_tokens in (300, 1000, 5000):  # median document length (news, Wikipedia, books)
        lengths = synthetic_lengths(doc_tokens, args.documents, args.max_seq_length)
        order = np.random.default_rng(1).permutation(len(lengths))
        usable = len(order) // args.batch * args.batch
        batches = lengths[order[:usable]].reshape(-1, args.batch)
        real = batches.sum()
        row = {
            "median_doc_tokens": doc_tokens,
            "examples": len(lengths),
            "full_length_share": float((lengths == args.max_seq_length).mean()),
            "padding_share_batch_max": float(1 - real / (batches.max(1).sum() * args.batch)),
            "padding_share_static": float(1 - real / (batches.size * args.max_seq_length)),
        }
        rows.append(row)
        print(json.dumps(row))
    return {"max_seq_length": args.max_seq_length, "batch": args.batch, "rows": rows}


# ----------------------------------------------------------------------------- GPU checks


def gpu_verify(args) -> dict:
    """CUDA only: equality checks (assert) and timings of flex, compile and apex."""
    if not torch.cuda.is_available():
        raise SystemExit("gpu-verify needs CUDA")
    from torch._dynamo.utils import counters

    from engine.engine import compile_encoder
    from model.attention.tisa import (
        PositionScorer,
    )
    from model.norm import LayerNorm, apex_layer_norm_fn, layer_norm_backend

    dev = "cuda"
    report: dict = {"device": torch.cuda.get_device_name()}

    # 1. TISA flex == SDPA bias, forward and gradients (q, k, v, scorer a/b/c), fp32 and bf16,
    #    f read from its table and from the dense (H, N, N) bias (tisa.flex_bias).
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        torch.manual_seed(0)
        B, H, N, h = 4, 12, 512, 64
        scorer = PositionScorer(5, H).to(dev)
        q, k, v = (
            torch.randn(B, H, N, h, device=dev, dtype=dtype, requires_grad=True) for _ in range(3)
        )
        mask = torch.ones(B, N, dtype=torch.bool, device=dev)
        mask[1, 300:] = False
        mask[3, 17:] = False
        results = {}
        for backend in ("flex", "flex_dense", "sdpa"):
            out = tisa_mixing(backend, q, k, v, scorer.values(N), mask, dtype)
            real = mask[:, None, :, None].expand_as(out)
            loss = out[real].float().square().sum()
            grads = torch.autograd.grad(loss, [q, k, v, scorer.a, scorer.b, scorer.c])
            results[backend] = (out[real].float(), [g.float() for g in grads])
        for flex in ("flex", "flex_dense"):
            torch.testing.assert_close(results[flex][0], results["sdpa"][0], rtol=tol, atol=tol)
            for g_flex, g_sdpa, name in zip(*(results[b][1] for b in (flex, "sdpa")), "qkvabc"):
                scale = g_sdpa.abs().max().clamp_min(1e-6)
                err = ((g_flex - g_sdpa).abs().max() / scale).item()
                assert err < (1e-3 if dtype == torch.float32 else 5e-2), (flex, dtype, name, err)
            report[f"{flex}_equals_sdpa_{str(dtype)[6:]}"] = True
            print(f"{flex} == sdpa bias", dtype, "ok")

    # 2. Training steps of a TISA model on the flex path do not recompile.
    torch._dynamo.reset()
    counters.clear()
    args.seq = [512]
    model = EncoderForPretraining(model_config("tisa", args, tisa={"backend": "flex"})).to(dev)
    ids, mask = make_batch(args, 512, dev)
    step = pretraining_step(model, ids, mask, lambda: torch.autocast("cuda", dtype=torch.bfloat16))
    for _ in range(3):
        step()
    frames = counters["stats"]["unique_graphs"]
    assert frames <= 2, f"flex recompiled: {frames} graphs for 3 steps"  # fwd (+ bwd lazily)
    report["flex_graphs_after_3_steps"] = frames
    print("flex graphs after 3 steps:", frames)

    # 3. Inductor-compiled encoder == eager, every family (fp32: tight tolerance).
    for family in FAMILY_OVERRIDES:
        torch._dynamo.reset()
        torch.manual_seed(0)
        eager = EncoderForPretraining(model_config(family, args)).to(dev)
        compiled = EncoderForPretraining(model_config(family, args)).to(dev)
        compiled.load_state_dict(eager.state_dict())
        compile_encoder(compiled, "inductor")
        grads = []
        for m in (eager, compiled):
            out = m(ids, mask)
            loss = out.logits.float().logsumexp(-1).mean() + out.sop_logits.float().sum()
            loss = loss + sum(out.aux_losses.values(), torch.zeros((), device=dev))
            loss.backward()
            grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
        assert grads[0].keys() <= grads[1].keys()
        # Relative to the largest gradient of the model: some are 0 in exact arithmetic (a
        # softmax key bias shifts every logit of a row alike), so their own scale is noise.
        scale = max(g.abs().max() for g in grads[0].values()).clamp_min(1e-12)
        for name, g in grads[0].items():
            err = ((grads[1][name] - g).abs().max() / scale).item()
            assert err < 1e-3, (family, name, err)
        report[f"compile_equals_eager_{family}"] = True
        print("compiled == eager:", family)

    # 4. apex LayerNorm == torch's (if NVIDIA apex is importable), and timings.
    if apex_layer_norm_fn() is not None:
        assert layer_norm_backend("cuda", False) == "apex"
        ln = LayerNorm(768, eps=1e-12, autocast_output="fp32").to(dev)  # as nn.LayerNorm
        torch.nn.init.normal_(ln.weight)
        torch.nn.init.normal_(ln.bias)
        x = torch.randn(32 * 512, 768, device=dev, requires_grad=True)
        for ac in (False, True):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ac):
                xin = x.bfloat16() if ac else x
                got = ln(xin)
                want = torch.nn.LayerNorm.forward(ln, xin)
            assert got.dtype == want.dtype, (got.dtype, want.dtype)
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-4, atol=1e-4)
        g = torch.randn_like(x)

        def fwd_bwd(fn):
            def run():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = fn(x.bfloat16())
                y.backward(g)

            return run

        t = time_steps(
            {
                "apex": fwd_bwd(ln),
                "torch": fwd_bwd(lambda z: torch.nn.LayerNorm.forward(ln, z)),
            },
            10,
            50,
            dev,
        )
        report["layer_norm_apex_over_torch"] = t["apex"] / t["torch"]
        print("LayerNorm apex / torch step time:", t["apex"] / t["torch"])
    else:
        report["apex"] = "not importable (torch LayerNorm used)"
        print("NVIDIA apex not importable: torch LayerNorm is used")

    # 5. TransJect: share of a training step spent evaluating the orthogonal maps (once per
    #    micro-batch forward; with gradient accumulation k they run k times per step).
    from model.orthogonal import orthogonal_cache, orthogonal_modules

    torch.manual_seed(0)
    tj = EncoderForPretraining(model_config("transject", args)).to(dev)
    found = orthogonal_modules(tj)

    def maps_only():
        with orthogonal_cache():
            total = sum(getattr(m, n).sum() for _, m, n in found)
        total.backward()

    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    t = time_steps(
        {"maps": maps_only, "step": pretraining_step(tj, ids, mask, autocast)}, 3, 20, dev
    )
    report["transject_orthogonal_maps_share_of_step"] = t["maps"] / t["step"]
    print("TransJect: orthogonal maps / training step:", t["maps"] / t["step"], len(found), "maps")

    # 6. Timings: TISA flex vs sdpa vs softmax; compile vs eager (bf16, ALBERT-base width).
    args.dtype = "bf16"
    args.seq = [512]
    report["tisa"] = bench_tisa(args)["rows"]
    args.families = list(FAMILY_OVERRIDES)
    report["compile"] = bench_compile(args)["rows"]
    return report


# ----------------------------------------------------------------------------- Cayley map


def bench_cayley(args) -> dict:
    """The Cayley map by block inverse (the default) against the LU solve it replaced and
    against torch's own parametrization (its checked `linalg.solve`), in one process:

    1. `--maps` matrices of `--hidden` x `--hidden` free parameters, forward + backward, with
       each method's largest error against the fp64 map and from orthogonality;
    2. a TransJect pretraining step (`--layers` distinct layers, as the recipes, `--hidden`,
       `--seq`, `--batch`, `--dtype`) with its maps by block inverse vs by LU, same model,
       interleaved;
    on CUDA also the block inverse with Gauss-Jordan leaves (`cayley_leaf_inverse:
    gauss_jordan`, "block_gj") in both, and 3. the leaves alone: the batch of maps' leaf-sized
    blocks inverted by LU (`inv_ex`) vs the Gauss-Jordan kernel.
    """
    from torch.nn.utils.parametrizations import _OrthMaps, _Orthogonal

    import model.orthogonal as orthogonal_module

    dev, d = args.device, args.hidden
    g = torch.Generator().manual_seed(0)
    X = torch.randn(args.maps, d, d, generator=g).to(dev).requires_grad_()
    G = torch.randn(args.maps, d, d, generator=g).to(dev)
    reference = _Orthogonal(X, _OrthMaps.cayley, use_trivialization=False)
    methods = {
        "block": lambda: orthogonal_module.cayley(X),
        "lu": lambda: orthogonal_module.cayley(X, method="lu"),
        "torch_parametrization": lambda: reference(X),
    }
    with_gj = dev == "cuda"  # off CUDA the Gauss-Jordan option is LU
    if with_gj:
        methods["block_gj"] = lambda: orthogonal_module.cayley(X, leaf_inverse="gauss_jordan")
    exact = orthogonal_module.cayley(X.detach().double(), method="lu")
    eye = torch.eye(d, device=dev)
    errors = {}
    for name, fn in methods.items():
        with torch.no_grad():
            Q = fn()
        errors[name] = {
            "max_error_vs_fp64": (Q.double() - exact).abs().max().item(),
            "orthogonality_error": (Q.mT @ Q - eye).abs().max().item(),
        }

    def fwd_bwd(fn):
        def run():
            X.grad = None
            (fn() * G).sum().backward()

        return run

    t = time_steps({k: fwd_bwd(f) for k, f in methods.items()}, args.warmup, args.repeats, dev)
    # What the block path moves outside its products, forward + backward (eager bytes of every
    # other operator, `bench/traffic_per_token.py`'s count): its element-wise passes.
    from traffic_per_token import counts_of, eager_traffic

    counter = eager_traffic()
    with counter:
        torch.autograd.backward(orthogonal_module.cayley(X), G)
    X.grad = None
    moved = counts_of(counter)["bytes"]
    maps = {
        "matrices": args.maps,
        "width": d,
        **{f"{k}_ms": 1000 * v for k, v in t.items()},
        "block_memory_gb": moved.get("memory", 0) / 1e9,
        "block_products_gb": moved.get("compute", 0) / 1e9,
        "lu_over_block": t["lu"] / t["block"],
        "torch_over_block": t["torch_parametrization"] / t["block"],
        "errors": errors,
    }
    if with_gj:
        maps["block_over_block_gj"] = t["block"] / t["block_gj"]
    print("Cayley maps fwd+bwd:", json.dumps(maps), flush=True)

    N = args.seq[0]
    ids, mask = make_batch(args, N, dev, padded=False)
    torch.manual_seed(1)
    # one distinct layer per depth, as TransJect's recipes (num_hidden_groups = layers)
    cfg = model_config("transject", args, num_hidden_groups=args.layers)
    tj = EncoderForPretraining(cfg).to(dev)
    step = pretraining_step(tj, ids, mask, autocast_for(args))
    block_map = orthogonal_module.cayley

    def with_method(method, leaf_inverse="lu"):
        def run():
            orthogonal_module.cayley = lambda X, **_: block_map(
                X, method=method, leaf_inverse=leaf_inverse
            )
            try:
                step()
            finally:
                orthogonal_module.cayley = block_map

        return run

    variants = {"block": with_method("block"), "lu": with_method("lu")}
    if with_gj:
        variants["block_gj"] = with_method("block", "gauss_jordan")
    t = time_steps(variants, args.warmup, args.repeats, dev)
    matrices = orthogonal_matrix_count(tj)
    steps = {
        "layers": args.layers,
        "matrices": matrices,
        "seq": N,
        "batch": args.batch,
        **{f"{k}_ms": 1000 * v for k, v in t.items()},
        "lu_over_block": t["lu"] / t["block"],
    }
    if with_gj:
        steps["block_over_block_gj"] = t["block"] / t["block_gj"]
    print("TransJect training step:", json.dumps(steps), flush=True)
    report = {"maps": maps, "transject_step": steps}
    if with_gj:  # 3. the leaves alone, as one leaf call of the block inverse sees them
        leaf = d
        while leaf > orthogonal_module.BLOCK_INVERSE_BASE:
            leaf //= 2
        Id = torch.eye(leaf, device=dev)
        M = Id - 0.5 * (X.detach()[:, :leaf, :leaf].tril() - X.detach()[:, :leaf, :leaf].tril().mT)
        shipped_warps = orthogonal_module.GAUSS_JORDAN_WARPS

        def gauss_jordan_with(warps):
            def run():
                orthogonal_module.GAUSS_JORDAN_WARPS = warps
                try:
                    orthogonal_module.gauss_jordan_inverse(M)
                finally:
                    orthogonal_module.GAUSS_JORDAN_WARPS = shipped_warps

            return run

        variants = {"lu": lambda: orthogonal_module._base_inverse(M, "lu")}
        variants.update({f"gauss_jordan_w{w}": gauss_jordan_with(w) for w in (4, 8, 16)})
        t = time_steps(variants, args.warmup, args.repeats, dev)
        ref = torch.linalg.inv(M.double())
        report["leaves"] = {
            "shape": list(M.shape),
            **{f"{k}_ms": 1000 * v for k, v in t.items()},
            "shipped_warps": shipped_warps,
            "lu_over_gauss_jordan": t["lu"] / t[f"gauss_jordan_w{shipped_warps}"],
            "lu_error": (torch.linalg.inv(M).double() - ref).abs().max().item(),
            "gauss_jordan_error": (orthogonal_module.gauss_jordan_inverse(M).double() - ref)
            .abs()
            .max()
            .item(),
        }
        print("Cayley leaves:", json.dumps(report["leaves"]), flush=True)
    return report


def broadcast_experts(self, x_BND, ctx):
    """TransJect's expert block as it was before (the reference of `transject-experts`): the
    batch broadcast against the (E, d, d) stacks, x[:, None] @ U, which torch runs by expanding
    U and V to (B, E, d, d) and reducing their gradients over B. Returns (a_EBND, w_BE) like
    `TransJectAttention.experts` (authors' V bias not supported here)."""
    from model.attention.transject import LAMBDA_KEY, _compute_dtype, residual_alpha

    assert self.expert_v_bias is None
    lam_B11d = _compute_dtype(x_BND, ctx.extras[LAMBDA_KEY])[:, None, None, :]  # fp32 in autocast
    xu_BEND = x_BND[:, None] @ _compute_dtype(x_BND, self.expert_u)
    if self.expert_u_bias is not None:
        xu_BEND = xu_BEND + self.expert_u_bias.bias.to(xu_BEND.dtype)[None, :, None, :]
    a_BEND = F.elu((xu_BEND * lam_B11d) @ _compute_dtype(x_BND, self.expert_v).mT)
    alpha = residual_alpha(ctx, self.num_applications).to(a_BEND.dtype)
    gated_BEND = x_BND[:, None] + alpha * a_BEND if self.gate_input == "sublayer" else a_BEND
    mask_B1N1 = ctx.mask_BN[:, None, :, None]
    pooled_BED = gated_BEND.masked_fill(~mask_B1N1, torch.finfo(a_BEND.dtype).min).amax(dim=2)
    w_BE = self.gate(pooled_BED).squeeze(-1).float().softmax(dim=-1)
    return a_BEND.transpose(0, 1), w_BE


def formula_eigen_state(x0_BND, mask_BN, U_dd, reconstruction="scale_free"):
    """TransJect's eigen-state as it was before (the reference of `transject-experts`): M, U^T M U
    and U diag(lambda) U^T formed, three d x d products per sample."""
    from model.attention.transject_eigen import _normalise

    with torch.autocast(device_type=x0_BND.device.type, enabled=False):
        x = x0_BND.float() * mask_BN.unsqueeze(-1).float()
        M = x.mT @ x
        U = U_dd.float()
        lam_raw = (U * (M @ U)).sum(dim=-2)
        lam, s = _normalise(lam_raw)
        recon = (U * lam[:, None, :]) @ U.mT
        target = M if reconstruction == "authors" else M / s[:, :, None]
        return lam, ((target - recon) ** 2).mean(dim=(-2, -1))


TRANSJECT_VARIANTS = ("now", "broadcast_experts", "formula_eigen_state", "before")
"""`transject-experts`'s eager variants; compiled, `TRANSJECT_COMPILED_VARIANTS`."""
TRANSJECT_COMPILED_VARIANTS = ("now", "scatter_gate", "einsum_mix", "before_compiled")


class ScatterGatePool:
    """The gate's pooled gather as it was before `PooledAt` (the reference of
    `transject-experts`'s `scatter_gate`): a plain gather, whose backward scatters into a
    zero-filled tensor of the source's shape."""

    @staticmethod
    def apply(src, index, dim):
        return src.gather(dim, index)


def einsum_mix(w_BE, a_EBND):
    """The experts mixed by the einsum also under torch.compile, as before `mix_experts` (the
    reference of `transject-experts`'s `einsum_mix`)."""
    return torch.einsum("be,ebnd->bnd", w_BE, a_EBND)


def bench_transject_experts(args) -> dict:
    """TransJect training steps as they are against as they were, same model, interleaved, after
    checking every gradient equal: the expert block as products over the whole batch (now) vs
    broadcast against the expert stacks (`broadcast_experts`), the eigen-state in closed form
    (now) vs its formulas (`formula_eigen_state`), each change alone and both. With
    `--compiled` (the encoder compiled as the engine does it, maps evaluated eagerly before it):
    the gate's pooled values with a dense backward (now) vs a gather's scatter
    (`scatter_gate`), the experts mixed by a sum (now) vs the einsum (`einsum_mix`), and both
    (`before_compiled`)."""
    import model.attention.transject as transject_module
    from model.attention.transject import TransJectAttention

    dev, N = args.device, args.seq[0]
    ids, mask = make_batch(args, N, dev)
    torch.manual_seed(1)
    # residual_init 1: not the identity at init (r_l = 0), so the experts' gradients are not 0
    transject = {"num_experts": 4, "residual_init": 1.0}
    # one distinct layer per depth, as TransJect's recipes (num_hidden_groups = layers)
    cfg = model_config("transject", args, transject=transject, num_hidden_groups=args.layers)
    tj = EncoderForPretraining(cfg).to(dev)
    step = pretraining_step(tj, ids, mask, autocast_for(args))
    if args.compiled:
        from engine.engine import compile_encoder
        from model.orthogonal import evaluate_orthogonal_maps, orthogonal_cache

        compile_encoder(tj, args.compile_backend)
        eager_step = step

        def step():  # the engine's maps up front, then the compiled encoder
            with orthogonal_cache() as store:
                evaluate_orthogonal_maps(tj, store)
                eager_step()

    # each variant: what it replaces, as (owner, attribute) -> the replacement
    experts_at, eigen_at = (
        (TransJectAttention, "experts"),
        (transject_module, "approximate_eigenvalues"),
    )
    pooled_at, mix_at = (transject_module, "PooledAt"), (transject_module, "mix_experts")
    variants = {
        "now": {},
        "broadcast_experts": {experts_at: broadcast_experts},
        "formula_eigen_state": {eigen_at: formula_eigen_state},
        "before": {experts_at: broadcast_experts, eigen_at: formula_eigen_state},
        # these two differ from now only compiled (eagerly the gate gathers and the mix is the
        # einsum in every variant)
        "scatter_gate": {pooled_at: ScatterGatePool},
        "einsum_mix": {mix_at: einsum_mix},
        "before_compiled": {pooled_at: ScatterGatePool, mix_at: einsum_mix},
    }
    # compiled: a graph per variant, the ones the compiled step is about
    keep = TRANSJECT_COMPILED_VARIANTS if args.compiled else TRANSJECT_VARIANTS
    variants = {k: variants[k] for k in ((args.only,) if args.only else keep)}

    def with_variant(name):
        patches = variants[name]
        originals = {at: getattr(*at) for at in patches}

        def run():
            for (owner, attribute), replacement in patches.items():
                setattr(owner, attribute, replacement)
            try:
                step()
            finally:
                for (owner, attribute), original in originals.items():
                    setattr(owner, attribute, original)

        return run

    if args.only:  # one variant alone in this process: its peak memory over two steps
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with_variant(args.only)()
        with_variant(args.only)()
        if dev == "cuda":
            peak_mb = torch.cuda.max_memory_allocated() / 2**20
        else:
            import resource

            peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        row = {"variant": args.only, "peak_mb": peak_mb, "device": dev, "batch": args.batch}
        print("TransJect peak memory:", json.dumps(row), flush=True)
        return {"peak": row}
    grads = {}
    for name in variants:
        with_variant(name)()
        grads[name] = {n: p.grad.clone() for n, p in tj.named_parameters() if p.grad is not None}
    scale = max(g.abs().max().item() for g in grads["now"].values())
    differences = {
        name: max((grads["now"][n] - g[n]).abs().max().item() for n in g) / scale
        for name, g in grads.items()
        if name != "now"
    }
    t = time_steps({k: with_variant(k) for k in variants}, args.warmup, args.repeats, dev)
    row = {
        "layers": args.layers,
        "width": args.hidden,
        "seq": N,
        "batch": args.batch,
        "dtype": args.dtype,
        "compiled": args.compiled,
        **{f"{k}_ms": 1000 * v for k, v in t.items()},
        **{f"{k}_over_now": v / t["now"] for k, v in t.items() if k != "now"},
        "largest_gradient_difference_relative": differences,
    }
    print("TransJect training step:", json.dumps(row), flush=True)
    return {"transject_step": row}


# ----------------------------------------------------------------------------- orthogonal cache


def bench_orthogonal_cache(args) -> dict:
    """TransJect inference forwards (eval, no grad) with the orthogonal maps kept across
    forwards (the default) vs evaluated in every forward (the kept matrices dropped before each
    call), same model, interleaved; plain softmax beside them for scale."""
    from model.orthogonal import FP32Orthogonal

    rows = []
    for N in args.seq:
        ids, mask = make_batch(args, N, args.device, padded=False)
        torch.manual_seed(0)
        tj = EncoderForPretraining(model_config("transject", args)).to(args.device).eval()
        torch.manual_seed(0)
        sm = EncoderForPretraining(model_config("softmax", args)).to(args.device).eval()
        maps = [m for m in tj.modules() if isinstance(m, FP32Orthogonal)]
        autocast = autocast_for(args)

        def forward(model, forget=False, maps=maps, autocast=autocast, ids=ids, mask=mask):
            def run():
                if forget:
                    for m in maps:
                        m._inference = None
                with torch.no_grad(), autocast():
                    model(ids, mask)

            return run

        t = time_steps(
            {
                "transject_kept": forward(tj),
                "transject_evaluated": forward(tj, forget=True),
                "softmax": forward(sm),
            },
            args.warmup,
            args.repeats,
            args.device,
        )
        row = {"seq": N, **{f"{k}_s": v for k, v in t.items()}}
        row["kept_speedup"] = t["transject_evaluated"] / t["transject_kept"]
        row["transject_kept_over_softmax"] = t["softmax"] / t["transject_kept"]
        row["transject_evaluated_over_softmax"] = t["softmax"] / t["transject_evaluated"]
        rows.append(row)
        print(json.dumps(row))
    return {"rows": rows, "orthogonal_maps": len(maps)}


def transject_engines(args, dist, option: str) -> dict:
    """{False: engine, True: engine}: the same TransJect pretraining model (same initial
    weights) through the engine with the boolean engine option `option` off and on; torch
    backend, the recipes' foreach LAMB, `--accumulation` micro-batches of `--batch`; with
    `--compiled`, `engine.compile` (`--compile-backend`)."""
    from engine.engine import Engine, EngineConfig
    from engine.optim import OptimizerConfig, ScheduleConfig

    engines = {}
    for on in (False, True):
        torch.manual_seed(0)
        model = EncoderForPretraining(model_config("transject", args))
        cfg = EngineConfig(
            backend="torch",
            device=args.device,
            precision="bf16-mixed" if args.dtype == "bf16" else "fp32",
            micro_batch_size=args.batch,
            gradient_accumulation_steps=args.accumulation,
            gradient_clipping=1.0,
            compile=args.compiled,
            compile_backend=args.compile_backend,
            orthogonal_shard_min_size=args.shard_min_size,
            **{option: on},
        )
        engines[on] = Engine(
            model,
            cfg,
            OptimizerConfig(name="lamb", lr=1e-4),
            ScheduleConfig(warmup_steps=0, total_steps=args.warmup + args.repeats),
            dist=dist,
        )
    return engines


def optimizer_step(engine, ids, mask):
    """One optimizer step of `engine` (its micro-batches, forward + backward, then the step),
    as pretraining runs it (`defer=True`)."""

    def run():
        for _ in range(engine.cfg.gradient_accumulation_steps):
            out = engine.forward(ids, mask, masked_positions=mask & (ids % 7 == 0))
            loss = out.logits.float().logsumexp(-1).mean() + out.sop_logits.float().sum()
            loss = loss + sum(out.aux_losses.values(), torch.zeros((), device=ids.device))
            engine.backward(loss, defer=True)
        engine.step(defer=True)

    return run


def race(engines: dict, names: tuple[str, str], ids, mask, args) -> tuple[dict, float]:
    """({name: median seconds per optimizer step}, the largest difference between the two
    engines' weights afterwards): the engines' steps interleaved, `names` for off and on."""
    t = time_steps(
        {
            names[0]: optimizer_step(engines[False], ids, mask),
            names[1]: optimizer_step(engines[True], ids, mask),
        },
        args.warmup,
        args.repeats,
        args.device,
    )
    diff = max(
        (a.detach().float() - b.detach().float()).abs().max().item()
        for a, b in zip(
            engines[False].module.parameters(), engines[True].module.parameters(), strict=True
        )
    )
    return t, diff


def bench_orthogonal_step(args) -> dict:
    """A TransJect training step with gradient accumulation (`--accumulation` micro-batches of
    `--batch` x N, forward + backward each, then the optimizer step) through the engine (torch
    backend, the recipes' foreach LAMB), with the orthogonal maps evaluated once per step
    (`engine.orthogonal_step_cache`, the default) vs once per micro-batch; two engines from the
    same initial weights, steps interleaved. Also checks that they stay equal (the largest
    weight difference after all the timed steps)."""
    from engine.distributed import DistEnv

    rows = []
    for N in args.seq:
        ids, mask = make_batch(args, N, args.device)
        engines = transject_engines(args, DistEnv.single(), "orthogonal_step_cache")
        maps = orthogonal_matrix_count(engines[True].module)

        t, diff = race(engines, ("per_micro_batch", "per_step"), ids, mask, args)
        row = {
            "seq": N,
            "batch": args.batch,
            "accumulation": args.accumulation,
            "compiled": args.compiled,
            "maps_per_forward": maps,
            "per_micro_batch_ms": 1e3 * t["per_micro_batch"],
            "per_step_ms": 1e3 * t["per_step"],
            "speedup": t["per_micro_batch"] / t["per_step"],
            "saved_per_micro_batch_ms": (
                1e3 * (t["per_micro_batch"] - t["per_step"]) / (args.accumulation - 1)
                if args.accumulation > 1
                else None  # nothing to share: the two engines are the same (a step's time)
            ),
            "max_weight_difference": diff,
        }
        rows.append(row)
        print(json.dumps(row))
    return {"rows": rows}


def maps_alone(model, sharding, args) -> dict[str, float]:
    """All of `model`'s orthogonal maps, forward + backward, as one training micro-batch maps
    them: every rank all of them, sharded, and the sharded collectives alone (the gather of
    the shares and its backward, on the free parameters instead of their maps)."""
    from model.orthogonal import OrthogonalStepCache, evaluate_orthogonal_maps

    def run(cache):
        def go():
            with cache.micro_batch(0, last=True):
                store: dict = {}
                evaluate_orthogonal_maps(model, store)
                sum(q.float().sum() for q in store.values()).backward()
            cache.reset()
            model.zero_grad(set_to_none=True)

        return go

    groups: dict = {}
    for m in model.modules():
        for plist in getattr(m, "parametrizations", {}).values():
            X = plist.original
            groups.setdefault(tuple(X.shape[-2:]), []).append(X)

    def collectives():
        for Xs in groups.values():
            flat = torch.cat([X.reshape(-1, *X.shape[-2:]) for X in Xs])
            rows = sharding.bounds(flat.size(0), tuple(flat.shape[-2:]))
            if rows is not None:
                sharding.gather(flat[rows[0] : rows[1]] * 1.0, flat.size(0)).sum().backward()
        model.zero_grad(set_to_none=True)

    return time_steps(
        {
            "every_rank_all": run(OrthogonalStepCache()),
            "sharded": run(OrthogonalStepCache(sharding)),
            "collectives": collectives,
        },
        args.warmup,
        args.repeats,
        args.device,
    )


def bench_orthogonal_shard(args) -> dict:
    """A TransJect training step on `--ranks` data-parallel ranks (torch backend: DDP over gloo
    on CPU, NCCL on GPUs; the recipes' foreach LAMB), the orthogonal maps evaluated in shards
    over the ranks (`engine.orthogonal_shard_maps`, the default) vs every rank mapping all of
    them; `--accumulation` micro-batches per step (default 1: no step cache to share the maps
    over micro-batches). Two engines from the same initial weights, steps interleaved, each
    rank on its own batch; rank 0 reports, with the largest weight difference after all timed
    steps. Relaunches itself under torchrun when started without it."""
    import os
    import subprocess

    if "RANK" not in os.environ:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={args.ranks}", __file__, *sys.argv[1:],
        ]  # fmt: skip
        subprocess.run(cmd, check=True)
        args.out = None  # rank 0 of the launched job wrote it
        return {"launched": cmd}

    from engine.distributed import detect
    from engine.engine import shutdown

    dist = detect()
    device = f"cuda:{dist.local_rank}" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(dist.local_rank)
    rows = []
    for N in args.seq:
        ids, mask = make_batch(args, N, device)
        ids = (ids + dist.rank) % args.vocab  # each rank its own batch
        engines = transject_engines(args, dist, "orthogonal_shard_maps")
        t, diff = race(engines, ("every_rank_all_maps", "sharded"), ids, mask, args)
        steps = engines[True].orthogonal_steps
        mapped = steps.evaluations / (args.warmup + args.repeats) if steps is not None else None
        maps = maps_alone(engines[True].module, steps.sharding, args)
        row = {
            "seq": N,
            "batch": args.batch,
            "accumulation": args.accumulation,
            "ranks": dist.world_size,
            "maps_per_step_rank0_sharded": mapped,
            "every_rank_all_maps_ms": 1e3 * t["every_rank_all_maps"],
            "sharded_ms": 1e3 * t["sharded"],
            "speedup": t["every_rank_all_maps"] / t["sharded"],
            "max_weight_difference": diff,
            **{f"maps_alone_{k}_ms": 1e3 * v for k, v in maps.items()},
        }
        rows.append(row)
        if dist.rank == 0:
            print(json.dumps(row))
        del engines
    shutdown()
    if dist.rank != 0:
        args.out = None  # rank 0 writes the report
    return {"rows": rows}


# ----------------------------------------------------------------------------- TISA backends


def diagonal_sums(grad_HNN: torch.Tensor) -> torch.Tensor:
    """(H, N, N) -> (H, 2N - 1): entry j - i + N - 1 of each head sums grad[h, i, j] over its
    diagonal; the gradient of `toeplitz_bias` without the indexing's scatter (a candidate, not
    in the model: slower on the CPU). Each row padded with N - 1 zeros on the left and N on the
    right (rows of L = 3N - 1), then read with a row stride of L + 1, which shifts row i by i:
    entry (i, c) is grad[i, c + i - (N - 1)], so column c is one diagonal; a sum over rows."""
    H, N = grad_HNN.shape[0], grad_HNN.shape[-1]
    padded = F.pad(grad_HNN, (N - 1, N))
    L = 3 * N - 1
    return padded.as_strided((H, N, 2 * N - 1), (N * L, L + 1, 1)).sum(dim=1)


class _ToeplitzByDiagonals(torch.autograd.Function):
    """`toeplitz_bias`'s indexing forward with `diagonal_sums` as its backward."""

    @staticmethod
    def forward(ctx, values_HM: torch.Tensor) -> torch.Tensor:
        from model.attention.tisa import toeplitz_bias

        return toeplitz_bias(values_HM)

    @staticmethod
    def backward(ctx, grad_HNN: torch.Tensor) -> torch.Tensor:
        return diagonal_sums(grad_HNN)


def bench_tisa_bias_grad(args) -> dict:
    """TISA's (H, N, N) bias from its (H, 2N - 1) table, forward + backward: the gradient by the
    indexing's scatter (the model's `toeplitz_bias`) vs by sums along the diagonals
    (`diagonal_sums`, a candidate), eager and compiled, fp32 (the table and the bias's gradient
    are fp32 in the SDPA path). Gradients checked equal."""
    from model.attention.tisa import toeplitz_bias

    rows = []
    for N in args.seq:
        g = torch.Generator().manual_seed(N)
        grad = torch.randn(args.heads, N, N, generator=g).to(args.device)
        variants = {}
        for name, bias_fn in (("index", toeplitz_bias), ("diagonal", _ToeplitzByDiagonals.apply)):
            for compiled in (False, True):

                def step(bias_fn=bias_fn, N=N, grad=grad):
                    values = torch.ones(args.heads, 2 * N - 1, device=args.device)
                    values.requires_grad_()
                    (bias_fn(values) * grad).sum().backward()
                    return values.grad

                variants[name + ("_compiled" if compiled else "")] = (
                    torch.compile(step) if compiled else step
                )
        torch._dynamo.reset()
        grads = {name: fn() for name, fn in variants.items()}
        for value in grads.values():
            torch.testing.assert_close(value, grads["index"], rtol=1e-5, atol=1e-3)
        times = time_steps(variants, args.warmup, args.repeats, args.device)
        row = {"N": N, "heads": args.heads, **{f"{k}_ms": v * 1e3 for k, v in times.items()}}
        row["speedup_eager"] = times["index"] / times["diagonal"]
        row["speedup_compiled"] = times["index_compiled"] / times["diagonal_compiled"]
        rows.append(row)
        print(json.dumps(row))
    print(
        f"\nTISA bias from its table, forward + backward, {args.device}, fp32, {args.heads} heads"
    )
    print(
        "| N | index ms | diagonal sums ms | speed-up | index compiled | diagonal compiled | speed-up |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['N']} | {r['index_ms']:.2f} | {r['diagonal_ms']:.2f} | {r['speedup_eager']:.2f}x "
            f"| {r['index_compiled_ms']:.2f} | {r['diagonal_compiled_ms']:.2f} "
            f"| {r['speedup_compiled']:.2f}x |"
        )
    return {"rows": rows, "where": f"{args.device}, torch {torch.__version__}"}


def bench_objective(args) -> dict:
    """The pretraining objective's loss terms (`pretrain.objective.objective_terms`: MLM and SOP
    cross-entropies and the accuracy counts) on bf16 logits (batch, slots, vocab), forward +
    backward, eager vs compiled as the trainer compiles them beside the encoder
    (`Engine.compile_beside`), timed, and the bytes each moves counted (eager: every operator's
    inputs and outputs; compiled: Inductor's kernels, as `bench/traffic_per_token.py` counts
    them). Losses, counts and gradients checked equal."""
    from traffic_per_token import InductorTraffic, counts_of, eager_traffic

    from engine.engine import compile_function
    from pretrain.objective import IGNORE, objective_terms, pretraining_loss

    b, k, v = args.batch, args.slots, args.vocab
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, k, v, generator=g).to(args.device, torch.bfloat16)
    sop_logits = torch.randn(b, 2, generator=g).to(args.device)
    labels = torch.randint(0, v, (b, args.max_seq_length), generator=g)
    labels[:, k - 2 :] = IGNORE  # each row: k - 2 masked tokens, 2 padding slots
    batch = {
        "mlm_labels": labels.to(args.device),
        "sop_labels": torch.tensor([0, 1] * (b // 2) + [0] * (b % 2), device=args.device),
    }

    def step(terms):
        x = logits.detach().requires_grad_()
        output = type("Out", (), {"logits": x, "sop_logits": sop_logits, "aux_losses": {}})
        loss = pretraining_loss(output, batch, terms)
        loss.total.backward()
        return loss, x.grad

    torch._dynamo.reset()
    compiled = compile_function(objective_terms, backend=args.compile_backend)
    with InductorTraffic("loss terms") as inductor:  # its graphs are generated in here
        fused, fused_grad = step(compiled)
    eager_counter = eager_traffic()
    with eager_counter:
        eager, eager_grad = step(objective_terms)
    torch.testing.assert_close(fused.parts["mlm"], eager.parts["mlm"], rtol=1e-5, atol=1e-5)
    assert all(float(fused.counts[c]) == float(eager.counts[c]) for c in eager.counts)
    torch.testing.assert_close(fused_grad.float(), eager_grad.float(), rtol=1e-2, atol=1e-6)
    times = time_steps(
        {"eager": lambda: step(objective_terms), "compiled": lambda: step(compiled)},
        args.warmup,
        args.repeats,
        args.device,
    )
    counted = {"eager": counts_of(eager_counter), "compiled": counts_of(inductor)}
    row = {
        "batch": b,
        "slots": k,
        "vocab": v,
        **{f"{name}_ms": t * 1e3 for name, t in times.items()},
        "speedup": times["eager"] / times["compiled"],
        **{f"{name}_gb": sum(c["bytes"].values()) / 1e9 for name, c in counted.items()},
        **{f"{name}_kernels": sum(c["ops"].values()) for name, c in counted.items()},
    }
    print(json.dumps(row))
    print(f"\nLoss terms, forward + backward, {args.device}, bf16 logits {b} x {k} x {v}")
    print("| | ms | speed-up | GB moved | operators / kernels |")
    print("|---|---|---|---|---|")
    for name in ("eager", "compiled"):
        print(
            f"| {name} | {row[name + '_ms']:.1f} | "
            f"{(row['speedup'] if name == 'compiled' else 1.0):.2f}x | "
            f"{row[name + '_gb']:.2f} | {row[name + '_kernels']} |"
        )
    return {"rows": [row], "by_op": counted, "where": f"{args.device}, torch {torch.__version__}"}


def bench_norm_output(args) -> dict:
    """The LayerNorms' output under bf16 autocast (`model.norm_output`): `compute` (bf16, the
    default) vs `fp32` (torch's CUDA autocast rule), a pretraining forward + backward of the
    same weights per family, eager or compiled (`--compiled`, as the engine compiles the
    encoder); the logits checked equal to bf16 rounding. On a GPU at the recipe's shape:
    `--hidden 768 --heads 12 --layers 12 --batch 64 --seq 512 --vocab 30000 --compiled`."""
    from engine.engine import compile_encoder

    N = args.seq[0]
    ids, mask = make_batch(args, N, args.device, padded=False)
    rows = []
    for family in args.families:
        torch._dynamo.reset()
        models = {}
        for output in ("compute", "fp32"):
            torch.manual_seed(0)
            models[output] = EncoderForPretraining(
                model_config(family, args, norm_output=output)
            ).to(args.device)
            if output != "compute":
                models[output].load_state_dict(models["compute"].state_dict())
            if args.compiled:
                compile_encoder(models[output], args.compile_backend)
        autocast = lambda: torch.autocast(args.device, dtype=torch.bfloat16)  # noqa: E731
        with torch.no_grad(), autocast():
            logits = {o: m(ids, mask).logits.float() for o, m in models.items()}
        scale = logits["fp32"].abs().max().item()
        error = (logits["compute"] - logits["fp32"]).abs().max().item() / scale
        assert error < 0.05, (family, error)
        times = time_steps(
            {o: pretraining_step(m, ids, mask, autocast) for o, m in models.items()},
            args.warmup,
            args.repeats,
            args.device,
        )
        row = {
            "family": family,
            "compiled": args.compiled,
            "batch": args.batch,
            "seq": N,
            "compute_ms": times["compute"] * 1e3,
            "fp32_ms": times["fp32"] * 1e3,
            "speedup": times["fp32"] / times["compute"],
            "logits_rel_diff": error,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        f"\nLayerNorm output under bf16 autocast, forward + backward, {args.device}, "
        f"{'compiled' if args.compiled else 'eager'}, {args.batch} x {N}, d = {args.hidden}"
    )
    print("| family | fp32 ms | compute (bf16) ms | speed-up | logits, relative difference |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['family']} | {r['fp32_ms']:.1f} | {r['compute_ms']:.1f} | "
            f"{r['speedup']:.3f}x | {r['logits_rel_diff']:.1e} |"
        )
    return {"rows": rows, "where": f"{args.device}, torch {torch.__version__}"}


def bench_eigen_products(args) -> dict:
    """TransJect's eigen-state with its two products in fp32 vs by three bf16 products
    (`transject.eigen_products=bf16x3`), and one bf16 product for scale, each against the same
    state in fp64: the normalised eigenvalues, the reconstruction loss, the eigenbasis error and
    the gradients of the embeddings and of the basis, on the embeddings of the recipe's model
    (`--hidden`, ALBERT-base's 768 by default here) for random tokens, one row padded; then the
    forward + backward time of each (CUDA: the bf16 products on tensor cores; on a CPU the
    three products cost three fp32 products, so time it on a GPU)."""
    import model.attention.transject_eigen as tj

    cfg = EncoderConfig.preset(
        "albert-base",
        attention="transject",
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=1,
    )
    torch.manual_seed(0)
    model = EncoderForPretraining(cfg)
    b, n = args.batch, args.seq[0]
    ids = torch.randint(5, cfg.vocab_size, (b, n))
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[min(1, b - 1), n // 2 :] = False  # one row half padding
    with torch.no_grad():
        x0 = model.encoder.embeddings(ids, None).float()
        if args.anisotropy:  # one direction shared by every token, its norm that many times
            shared = torch.randn(x0.size(-1), generator=torch.Generator().manual_seed(2))
            x0 = x0 + args.anisotropy * x0.norm(dim=-1).mean() * shared / shared.norm()
        x0 = x0.to(args.device)
        basis = model.encoder.family_state.eigenbasis.detach().float().to(args.device)
    mask = mask.to(args.device)
    weights = torch.randn(b, cfg.hidden_size, generator=torch.Generator().manual_seed(1))

    def one_product(a, c):
        return (a.to(torch.bfloat16).float() @ c.to(torch.bfloat16).float()).float()

    def state(products: str, dtype=torch.float32):
        x = x0.to(dtype).clone().requires_grad_()
        u = basis.to(dtype).clone().requires_grad_()
        xm = x * mask.unsqueeze(-1).to(dtype)
        # bf16x1: one bf16 product each, fp32 accumulation (for scale only)
        product = one_product if products == "bf16x1" else tj.EIGEN_PRODUCTS[products]
        lam_raw, energy = tj._basis_diagonal(xm, u, product), tj._gram_energy(xm, product)
        lam, recon = tj._lambda_and_reconstruction(lam_raw, energy, "scale_free")
        error = tj._eigenbasis_error(lam_raw, energy)
        loss = recon.sum() + (lam * weights.to(lam)).sum()
        loss.backward()
        return {
            "lambda": lam.detach().double(),
            "reconstruction": recon.detach().double(),
            "eigenbasis_error": error.detach().double(),
            "grad_embeddings": x.grad.double(),
            "grad_basis": u.grad.double(),
        }

    reference = state("fp32", torch.float64)
    rows = []
    for products in ("fp32", "bf16x3", "bf16x1"):
        got = state(products)
        row = {"products": products}
        for key, ref in reference.items():
            row[key] = float((got[key] - ref).norm() / ref.norm())
        # the worst eigenvalue, relative to itself (the small ones are what fp32 is kept for)
        lam_ref = reference["lambda"]
        row["lambda_worst"] = float(((got["lambda"] - lam_ref).abs() / lam_ref.abs()).max())
        rows.append(row)
        print(json.dumps(row))
    times = time_steps(
        {p: (lambda p=p: state(p)) for p in ("fp32", "bf16x3")},
        args.warmup,
        args.repeats,
        args.device,
    )
    for row in rows:
        if row["products"] in times:
            row["ms"] = times[row["products"]] * 1e3
    print(
        f"\nEigen-state, {b} x {n} x {cfg.hidden_size}, anisotropy {args.anisotropy}, "
        f"{args.device}: relative error against fp64 (norm of the difference / norm of fp64's; "
        "worst eigenvalue: the largest error of one eigenvalue relative to itself); "
        f"|lambda| from {float(reference['lambda'].abs().min()):.1e} to 1"
    )
    print(
        "| products | lambda | worst eigenvalue | reconstruction | eigenbasis error "
        "| grad embeddings | grad basis | ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ms = f"{r['ms']:.1f}" if "ms" in r else ""
        print(
            f"| {r['products']} | {r['lambda']:.1e} | {r['lambda_worst']:.1e} | "
            f"{r['reconstruction']:.1e} | "
            f"{r['eigenbasis_error']:.1e} | {r['grad_embeddings']:.1e} | {r['grad_basis']:.1e} | {ms} |"
        )
    return {"rows": rows, "where": f"{args.device}, torch {torch.__version__}"}


def bench_tisa_backends(args) -> dict:
    """TISA's mixing step alone, forward + backward (into q, k, v and the scorer's a, b, c), per
    sequence length: FlexAttention (score_mod + key-padding block mask) reading f from its
    table (`flex`, `tisa.flex_bias: table`) or from the (H, N, N) bias (`flex_dense`) vs SDPA
    with the materialised bias, and the `split` backend (SDPA with that bias detached, f's
    gradient by its Triton kernels; `--split-options` adds variants of their tile size and launch
    options), on a padded batch (a quarter of the rows half padding) and an unpadded one (no
    mask). Checks that each of these agrees with SDPA at the real tokens, gradients included,
    then times them (median) beside softmax's SDPA without any bias (the TISA target's peer;
    `*_over_softmax` in the rows). On the CPU (a smoke run: no flex variant, FlexAttention has
    no CPU backward; split's gradient is the dense reference there) the rest runs. Reports
    `flex_min_length` (and
    `flex_dense_min_length`): the shortest length from which that flex variant is the faster
    on both batches at every longer length measured, the value for `tisa.flex_min_length`.
    SDPA running out of memory counts as flex faster. CUDA only (flex has no CPU backward)."""
    from torch._inductor.exc import InductorError
    from torch.nn.attention import SDPBackend

    from model.attention.tisa import PositionScorer, sdpa_bias

    compile_errors: tuple[type[Exception], ...] = (InductorError,)
    try:  # the split backend's Triton kernels: a compile error of theirs too
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources

        compile_errors += (CompilationError, OutOfResources)
    except ImportError:
        pass

    dev, dtype = args.device, torch.bfloat16 if args.dtype == "bf16" else torch.float32
    failed: dict[str, str] = {}  # variant -> the first line of its compile error
    if dev != "cuda":
        failed.update(flex="no CPU backward", flex_dense="no CPU backward")
    elif args.no_flex:
        failed.update(flex="--no-flex", flex_dense="--no-flex")
    H, h, B = args.heads, args.hidden // args.heads, args.batch
    splits = ["split", *(f"split:{o}" for o in args.split_options)]
    rows = []
    for N in args.seq:
        torch.manual_seed(0)
        scorer = PositionScorer(5, H).to(dev)
        q, k, v = (
            torch.randn(B, H, N, h, device=dev, dtype=dtype, requires_grad=True) for _ in range(3)
        )
        g = torch.randn(B, H, N, h, device=dev, dtype=dtype)
        mask = torch.ones(B, N, dtype=torch.bool, device=dev)
        mask[: max(1, B // 4), N // 2 :] = False
        params = [q, k, v, scorer.a, scorer.b, scorer.c]

        def step(backend, padded, scorer=scorer, q=q, k=k, v=v, g=g, mask=mask, N=N, params=params):
            m = mask if padded else None

            def run():
                with split_kernel_options(backend):
                    out = tisa_mixing(backend, q, k, v, scorer.values(N), m, dtype)
                    return out, torch.autograd.grad(out, params, g, allow_unused=True)

            return run

        row: dict = {"seq": N}
        for padded in (True, False):
            name = "padded" if padded else "unpadded"
            # The kernel SDPA's dispatcher picks with the bias as `sdpa` passes it (it needs a
            # gradient) and as `split` does (detached).
            bias = sdpa_bias(scorer.values(N), mask if padded else None, dtype)
            for path, attn_mask in (("sdpa", bias), ("split", bias.detach())):
                choice = torch._fused_sdp_choice(q, k, v, attn_mask=attn_mask)
                row[f"{path}_kernel_{name}"] = SDPBackend(choice).name
            del bias
            for flex in ("flex", "flex_dense", *splits):
                key = {"flex": "agree_", "flex_dense": "agree_dense_"}.get(flex, f"agree_{flex}_")
                key += name
                if flex in failed:
                    row[key] = None
                    continue
                try:
                    (o_f, g_f), (o_s, g_s) = step(flex, padded)(), step("sdpa", padded)()
                    real = mask[:, None, :, None].expand_as(o_f) if padded else slice(None)
                    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
                    torch.testing.assert_close(
                        o_f[real].float(), o_s[real].float(), rtol=tol, atol=tol
                    )
                    for a, b_, what in zip(g_f, g_s, ("q", "k", "v", "a", "b", "c")):
                        err = ((a - b_).abs().max() / b_.abs().max().clamp_min(1e-6)).item()
                        limit = 5e-2 if dtype == torch.bfloat16 else 1e-3
                        assert err < limit, (flex, N, name, what, err)
                    row[key] = True
                    del o_f, g_f, o_s, g_s
                except torch.OutOfMemoryError:
                    row[key] = "out of memory"
                except compile_errors as error:  # a kernel that does not compile: on with the rest
                    failed[flex] = first_line(error)
                    row[key] = None
                    print(f"{flex} does not compile at N = {N}: {failed[flex]}", flush=True)
                torch.cuda.empty_cache()
            for backend in ("flex", "flex_dense", *splits, "sdpa", "softmax"):
                row[f"{backend}_{name}_ms"] = None
                if backend in failed:
                    continue
                try:
                    t = time_steps({backend: step(backend, padded)}, args.warmup, args.repeats, dev)
                    row[f"{backend}_{name}_ms"] = 1000 * t[backend]
                except torch.OutOfMemoryError:
                    pass
                except compile_errors as error:
                    failed[backend] = first_line(error)
                torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)

    def flex_wins(row, flex: str) -> bool:
        return all(
            row[f"sdpa_{n}_ms"] is None
            or (row[f"{flex}_{n}_ms"] is not None and row[f"{flex}_{n}_ms"] < row[f"sdpa_{n}_ms"])
            for n in ("padded", "unpadded")
        )

    for row in rows:  # the ratios the TISA target is about: each path over softmax's SDPA
        for backend in ("flex", "flex_dense", *splits, "sdpa"):
            for n in ("padded", "unpadded"):
                t, peer = row.get(f"{backend}_{n}_ms"), row.get(f"softmax_{n}_ms")
                row[f"{backend}_{n}_over_softmax"] = t / peer if t and peer else None
    device = torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or "cpu"
    report = {"rows": rows, "device": device, "failed": failed}
    for flex in ("flex", "flex_dense"):
        threshold = None
        for row in reversed(rows):
            if not flex_wins(row, flex):
                break
            threshold = row["seq"]
        report[f"{flex}_min_length"] = threshold
        print(f"{flex} faster from N =", threshold, "(None: not at the longest length measured)")
    return report


def saved_bytes(forward, inputs: list[torch.Tensor]) -> int:
    """Bytes that autograd keeps for the backward of `forward()` beyond the storage of
    `inputs`: the distinct storages of the tensors it saves (activation memory)."""
    owned = {x.untyped_storage().data_ptr() for x in inputs}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in owned:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(kept.values())


def layer_saved_bytes(args, N: int, backend: str) -> int:
    """Activation memory of one kernel attention (aoglu) layer's training forward, one sequence
    of N tokens, `kernel.training_backend` = backend, under the autocast of `--dtype`: every
    storage autograd keeps for the backward (embeddings included, the same in both)."""
    from model import Encoder

    torch.manual_seed(0)
    one_layer = argparse.Namespace(**{**vars(args), "layers": 1})
    kernel = {"feature_map": "aoglu", "training_backend": backend}
    cfg = model_config("kernel", one_layer, kernel=kernel)
    model = Encoder(cfg).to(args.device).train()
    ids = torch.randint(5, cfg.vocab_size, (1, N), device=args.device)
    with autocast_for(args)():
        return saved_bytes(lambda: model(ids, None), [])


def mixing_kernel_options(variant: str):
    """`triton:BLOCK:WARPS:STAGES` -> those `GRAD_KERNEL_OPTIONS` (the training mixing's
    backward kernels) while the block runs."""
    from model.attention import kernel_triton

    return kernel_options(kernel_triton.GRAD_KERNEL_OPTIONS, variant, "BLOCK_N")


def bench_kernel_mixing(args) -> dict:
    """Kernel attention's mixing alone (what follows the feature maps in a training step),
    forward + backward into phi(q), phi(k) and v, per sequence length, in bf16 features as the
    model makes them (heads-first tensors; v a view of the fused projection): the torch
    operators (`kernel_mixing`, `kernel.training_backend: torch`), eager and compiled, against
    the Triton operator (`training_backend: triton`; `--mixing-options` adds variants of its
    backward kernels' tiles and launches), beside softmax's SDPA forward + backward on q, k, v
    of the same shape (the kernel target's peer), and the activation memory each keeps for its
    backward beyond its inputs (`saved_mb`, eager), and a whole layer's per sequence with each
    backend (`layer_*_saved_mb`: the features and the fused projection that the operator keeps
    count there). On CUDA it first checks, on a padded and an
    unpadded batch, that the Triton operator's output and gradients are within 2^-8 (relative
    norm) of the torch path's, then times the unpadded batch. On the CPU only `torch` and
    `softmax` run (the Triton kernels need CUDA, or Triton's interpreter: TRITON_INTERPRET=1
    runs them too, slowly, a smoke run of this benchmark)."""
    from model.attention.kernel import kernel_mixing
    from model.attention.kernel_triton import interpreting, kernel_attention_train

    dev, dtype = args.device, torch.bfloat16 if args.dtype == "bf16" else torch.float32
    H, h, B = args.heads, args.hidden // args.heads, args.batch
    tritons = ["triton", *(f"triton:{o}" for o in args.mixing_options)]
    if dev != "cuda" and not interpreting():  # TRITON_INTERPRET=1: a (slow) smoke run
        tritons = []
    compiled_mixing = torch.compile(kernel_mixing, dynamic=False)
    rows = []
    for N in args.seq:
        torch.manual_seed(0)
        feats = [  # positive features, heads first as the feature maps leave them
            F.softplus(torch.randn(H, B, N, h, device=dev)).to(dtype).transpose(0, 1)
            for _ in range(2)
        ]
        qkv = torch.randn(B, N, 3, H, h, device=dev, dtype=dtype)
        leaves = [x.detach().requires_grad_() for x in (*feats, qkv)]
        g = torch.randn(B, H, N, h, device=dev, dtype=dtype)
        padded = torch.ones(B, N, dtype=torch.bool, device=dev)
        padded[: max(1, B // 4), N // 2 :] = False

        def forward(variant, mask=None, leaves=leaves):
            phi_q, phi_k, qkv_ = leaves
            q_, k_, v_ = (x.transpose(1, 2) for x in qkv_.unbind(2))
            if variant == "softmax":
                return F.scaled_dot_product_attention(q_, k_, v_), [qkv_]
            mix = {"torch": kernel_mixing, "torch_compiled": compiled_mixing}.get(
                variant, kernel_attention_train
            )
            return mix(phi_q, phi_k, v_, mask, 1e-6, dtype), leaves

        def step(variant, mask=None, g=g):
            def run():
                with mixing_kernel_options(variant):
                    out, inputs = forward(variant, mask)
                    return out, torch.autograd.grad(out, inputs, g)

            return run

        row: dict = {"seq": N}
        for variant in ("softmax", "torch", *tritons[:1]):  # eager: the hooks see every tensor
            row[f"{variant}_saved_mb"] = saved_bytes(lambda v=variant: forward(v), leaves) / 1e6
        for backend in ("torch", *tritons[:1]):  # a whole layer's, per sequence
            row[f"layer_{backend}_saved_mb"] = layer_saved_bytes(args, N, backend) / 1e6
        for variant in tritons:  # agreement with the torch path first
            for name, mask in (("padded", padded), ("unpadded", None)):
                (o_t, g_t), (o_r, g_r) = step(variant, mask)(), step("torch", mask)()
                errs = [
                    ((a.float() - b.float()).norm() / b.float().norm()).item()
                    for a, b in zip((o_t, *g_t), (o_r, *g_r))
                ]
                row[f"{variant}_rel_err_{name}"] = max(errs)
                assert max(errs) <= 2**-8, (variant, N, name, errs)
        for variant in ("softmax", "torch", "torch_compiled", *tritons):
            try:
                t = time_steps({variant: step(variant)}, args.warmup, args.repeats, dev)
                row[f"{variant}_ms"] = 1000 * t[variant]
            except torch.OutOfMemoryError:
                row[f"{variant}_ms"] = None
            if dev == "cuda":
                torch.cuda.empty_cache()
        for variant in ("torch", "torch_compiled", *tritons):
            t, soft = row[f"{variant}_ms"], row["softmax_ms"]
            row[f"{variant}_speedup_over_softmax"] = soft / t if t and soft else None
        for variant in tritons:
            t, ref = row[f"{variant}_ms"], row["torch_compiled_ms"]
            row[f"{variant}_speedup_over_torch_compiled"] = ref / t if t and ref else None
        rows.append(row)
        print(json.dumps(row), flush=True)
    device = torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or "cpu"
    return {"rows": rows, "device": device}


# ----------------------------------------------------------------------------- attention checks


def attention_checks(args) -> dict:
    """CUDA checks (assert) of the attention fast paths, with timings where there is an old
    path to compare with: softmax runs under flash-only SDPA on an unpadded batch (no mask) and
    under cuDNN / memory-efficient on a padded one (float key-padding bias), and the step time
    with each kind of mask; kernel attention's fp32-
    accumulating products of bf16 features against fp64, gradients included, and its step time
    with fp32 vs bf16 feature maps; the orthogonal
    maps evaluated in one batched solve == one by one, outputs and gradients, and their times;
    the key-padding BlockMask == create_block_mask's."""
    if not torch.cuda.is_available():
        raise SystemExit("attention-checks needs CUDA")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask

    from model.attention.kernel import matmul_fp32
    from model.attention.tisa import key_padding_block_mask
    from model.orthogonal import (
        FP32Orthogonal,
        evaluate_orthogonal_maps,
        orthogonal_cache,
        orthogonal_modules,
    )

    dev = "cuda"
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    bf16 = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731

    # 1. Softmax: which SDPA kernels the masks allow (a kernel that cannot run raises).
    torch.manual_seed(0)
    model = EncoderForPretraining(model_config("softmax", args)).to(dev)
    ids, pad_mask = make_batch(args, 512, dev)
    for name, mask, backends in (
        ("unpadded_no_mask_flash", None, [SDPBackend.FLASH_ATTENTION]),
        ("unpadded_no_mask_cudnn", None, [SDPBackend.CUDNN_ATTENTION]),
        ("padded_float_bias_cudnn", pad_mask, [SDPBackend.CUDNN_ATTENTION]),
        ("padded_float_bias_efficient", pad_mask, [SDPBackend.EFFICIENT_ATTENTION]),
    ):
        try:
            with sdpa_kernel(backends), bf16():
                model(ids, mask).logits.float().sum().backward()
            report[f"sdpa_{name}"] = "runs"
        except RuntimeError as e:
            report[f"sdpa_{name}"] = f"refused: {str(e).splitlines()[0][:120]}"
        print("softmax", name, report[f"sdpa_{name}"], flush=True)
    assert report["sdpa_unpadded_no_mask_flash"] == "runs"

    # The same unpadded batch with each kind of attn_mask the kernel could pass.
    import model.attention.softmax as softmax_module
    from model.attention.base import key_padding_bias

    kinds = {
        "float_bias": lambda ctx, dtype: key_padding_bias(ctx.mask_BN, dtype),
        "bool_mask": lambda ctx, dtype: ctx.mask_BN[:, None, None, :],
        "no_mask": lambda ctx, dtype: None,
    }
    real_mask_fn = softmax_module.sdpa_key_mask
    t = {}
    try:
        for name, kind in kinds.items():
            softmax_module.sdpa_key_mask = kind

            def run():
                with bf16():
                    out = model(ids, torch.ones_like(pad_mask))
                out.logits.float().sum().backward()

            t.update(time_steps({name: run}, args.warmup, args.repeats, dev))
    finally:
        softmax_module.sdpa_key_mask = real_mask_fn
    report["softmax_step_ms_unpadded_batch"] = {k: 1000 * v for k, v in t.items()}
    print("softmax step (ms), unpadded batch:", report["softmax_step_ms_unpadded_batch"])

    # 2. Kernel attention's products: bf16 inputs, fp32 products and gradients.
    torch.manual_seed(1)
    a = torch.rand(8, 12, 64, 8192, device=dev).bfloat16().requires_grad_()
    b = torch.randn(8, 12, 8192, 64, device=dev).bfloat16().requires_grad_()
    c = torch.randn(8, 12, 64, 65, device=dev, requires_grad=True)  # fp32 (hi/lo split)
    for x, y in ((a, b), (b, c)):
        out = matmul_fp32(x, y)
        ref = x.double() @ y.double()
        assert out.dtype == torch.float32
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, err
        gx, gy = torch.autograd.grad(out, [x, y], torch.ones_like(out))
        rx, ry = torch.autograd.grad(ref, [x, y], torch.ones_like(ref))
        for got, want in ((gx, rx), (gy, ry)):
            err = ((got.double() - want).abs().max() / want.abs().max()).item()
            assert err < 1e-2, err
    report["kernel_matmul_fp32_ok"] = True
    print("kernel attention: fp32 products of bf16 features ok", flush=True)

    # 3. Orthogonal maps: one batched solve per shape == one solve per map; times.
    torch.manual_seed(2)
    tj = EncoderForPretraining(
        model_config("transject", argparse.Namespace(**{**vars(args), "layers": 2}))
    ).to(dev)
    found = orthogonal_modules(tj)

    def maps(grouped: bool):
        def run():
            with orthogonal_cache() as store:
                if grouped:
                    evaluate_orthogonal_maps(tj.encoder, store)
                mats = [getattr(m, n) for _, m, n in found]
            total = sum(
                (w * torch.linspace(0, 1, w.numel(), device=dev).view_as(w)).sum() for w in mats
            )
            grads = torch.autograd.grad(
                total, [p for p in tj.parameters() if p.requires_grad], allow_unused=True
            )
            return mats, grads

        return run

    (m1, g1), (m2, g2) = maps(False)(), maps(True)()
    for x, y in zip(m1, m2):
        assert (x - y).abs().max().item() < 1e-5
    for x, y in zip(g1, g2):
        if x is not None:
            assert ((x - y).abs().max() / x.abs().max().clamp_min(1e-12)).item() < 1e-4
    t = time_steps({"per_map": maps(False), "grouped": maps(True)}, 3, 20, dev)
    matrices = orthogonal_matrix_count(tj)
    report["orthogonal_maps"] = {
        "tensors": len(found),
        "matrices": matrices,
        "per_map_ms": 1000 * t["per_map"],
        "grouped_ms": 1000 * t["grouped"],
    }
    print("orthogonal maps fwd+bwd:", report["orthogonal_maps"], flush=True)
    assert FP32Orthogonal is not None

    # 3b. Before/after in one process: a TransJect training step with the maps evaluated one by
    #     one through torch.linalg.solve (the old path: a host sync per map) vs batched.
    import model.encoder as encoder_module
    import model.orthogonal as orthogonal_module

    ids512, mask512 = make_batch(args, 512, dev)
    tj_args = argparse.Namespace(**{**vars(args), "layers": 2})
    torch.manual_seed(2)
    tj = EncoderForPretraining(model_config("transject", tj_args)).to(dev)
    real_solve, real_eval = orthogonal_module._solve, encoder_module.evaluate_orthogonal_maps

    def checked_solve(B, C):
        return torch.linalg.solve(B, C)

    step = pretraining_step(tj, ids512, mask512, bf16)
    t = {}
    try:
        orthogonal_module._solve = checked_solve
        encoder_module.evaluate_orthogonal_maps = lambda *a, **k: None
        t.update(time_steps({"per_map_checked_solve_old": step}, args.warmup, args.repeats, dev))
    finally:
        orthogonal_module._solve, encoder_module.evaluate_orthogonal_maps = real_solve, real_eval
    t.update(time_steps({"batched": step}, args.warmup, args.repeats, dev))
    report["transject_step_ms"] = {k: 1000 * v for k, v in t.items()}
    print("TransJect training step (ms), 2 layers:", report["transject_step_ms"], flush=True)

    # 3c. Kernel attention (aoglu) training step: feature maps in fp32 (the old path, emulated
    #     by making the compute dtype fp32) vs in bf16 (the default); the products in fp32 in
    #     both (an earlier variant with bf16 products accumulating in fp32 through
    #     bmm(out_dtype=float32) and a hi/lo split measured slower: docs/methods.md). At 512
    #     tokens (batch 32) and 4096 (batch 4).
    import model.attention.kernel as kernel_module

    real_dtype, real_mm = kernel_module.compute_dtype, kernel_module.matmul_fp32
    variants = {
        "fp32_features_old": (lambda x: torch.float32, real_mm),
        "bf16_features": (real_dtype, real_mm),
    }
    report["kernel_step_ms"] = {}
    for N, B in ((512, args.batch), (4096, max(1, args.batch // 8))):
        torch.manual_seed(3)
        km_args = argparse.Namespace(**{**vars(args), "batch": B, "seq": [N]})
        km = EncoderForPretraining(model_config("kernel", km_args)).to(dev)
        ids_n, mask_n = make_batch(km_args, N, dev)
        step = pretraining_step(km, ids_n, mask_n, bf16)
        t = {}
        try:
            for name, (dtype_fn, mm_fn) in variants.items():
                kernel_module.compute_dtype, kernel_module.matmul_fp32 = dtype_fn, mm_fn
                t.update(time_steps({name: step}, args.warmup, args.repeats, dev))
        finally:
            kernel_module.compute_dtype, kernel_module.matmul_fp32 = real_dtype, real_mm
        report["kernel_step_ms"][f"N={N},B={B}"] = {k: 1000 * v for k, v in t.items()}
        print(f"kernel attention training step (ms), N={N} B={B}:", t, flush=True)

    # 4. The key-padding BlockMask == create_block_mask's, at a few lengths.
    for N in (100, 128, 300, 1024):
        m = torch.rand(3, N, device=dev) > 0.2
        m[0] = True
        m[1, N // 3 :] = False
        ours = key_padding_block_mask(m)
        ref = create_block_mask(lambda b, h, q, kv, m=m: m[b, kv], 3, None, N, N, device=dev)
        for attr in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            got, want = getattr(ours, attr), getattr(ref, attr)
            n = want.shape[-1]
            if attr.endswith("indices"):  # only the first count entries matter
                counts = getattr(ref, attr.replace("indices", "num_blocks"))
                keep = torch.arange(n, device=dev) < counts[..., None]
                assert torch.equal(got[keep], want[keep]), (N, attr)
            else:
                assert torch.equal(got, want), (N, attr)
    report["block_mask_equals_create_block_mask"] = True
    print("key-padding BlockMask == create_block_mask", flush=True)
    return report


# ----------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "what",
        choices=[
            "tisa", "compile", "grouping", "pretrain-padding", "orthogonal-cache", "gpu-verify",
            "tisa-backends", "attention-checks", "orthogonal-step", "orthogonal-shard", "cayley",
            "transject-experts", "tisa-bias-grad", "objective", "eigen-products", "norm-output",
            "kernel-mixing",
        ],
    )  # fmt: skip
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--seq", type=int, nargs="+", default=[128, 512])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--families", nargs="+", default=["softmax", "tisa", "kernel", "transject"])
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument(
        "--compiled",
        action="store_true",
        help="orthogonal-step / orthogonal-shard: both engines with engine.compile; "
        "transject-experts, norm-output: the encoder compiled as the engine does",
    )
    p.add_argument(
        "--slots", type=int, default=77, help="objective: the MLM head's slots per row (K)"
    )
    p.add_argument(
        "--anisotropy",
        type=float,
        default=0.0,
        help="eigen-products: add to every embedding one shared direction of this many times "
        "the tokens' mean norm (a wide spectrum, as trained embeddings tend to have)",
    )
    p.add_argument("--examples", type=int, default=1024, help="grouping: training examples")
    p.add_argument("--documents", type=int, default=2000, help="pretrain-padding: documents")
    p.add_argument("--max-seq-length", type=int, default=512)
    p.add_argument(
        "--accumulation", type=int, default=4, help="orthogonal-step: micro-batches per step"
    )
    p.add_argument("--ranks", type=int, default=2, help="orthogonal-shard: data-parallel ranks")
    p.add_argument(
        "--maps",
        type=int,
        default=121,
        help="cayley: matrices in the batch (TransJect albert-base: 121)",
    )
    p.add_argument(
        "--shard-min-size", type=int, default=256, help="engine.orthogonal_shard_min_size"
    )
    p.add_argument(
        "--only",
        choices=sorted(set(TRANSJECT_VARIANTS + TRANSJECT_COMPILED_VARIANTS)),
        default=None,
        help="transject-experts: run one variant alone and report its peak memory (CPU: the "
        "process's peak RSS; CUDA: torch's peak allocation)",
    )
    p.add_argument(
        "--no-flex",
        action="store_true",
        help="tisa-backends: without the FlexAttention variants (no compile: split, sdpa, softmax)",
    )
    p.add_argument(
        "--split-options",
        nargs="*",
        default=[],
        metavar="BLOCK:WARPS:STAGES",
        help="tisa-backends: the split backend with these kernel options too (e.g. 128:8:2)",
    )
    p.add_argument(
        "--mixing-options",
        nargs="*",
        default=[],
        metavar="BLOCK:WARPS:STAGES",
        help="kernel-mixing: the training mixing's backward kernels with these options too",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.threads and args.what == "cayley" and args.device == "cpu":
        # torch's parametrization solves the maps in one batched call, which oneMKL (torch
        # 2.13's CPU build) leaves hanging once set_num_threads has been called
        p.error("cayley on the CPU: leave out --threads (a batched solve hangs after it)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.what == "gpu-verify":
        args.hidden, args.heads, args.layers, args.batch = 768, 12, 12, 32
    run = {
        "tisa": bench_tisa,
        "compile": bench_compile,
        "grouping": bench_grouping,
        "pretrain-padding": bench_pretrain_padding,
        "orthogonal-cache": bench_orthogonal_cache,
        "gpu-verify": gpu_verify,
        "tisa-backends": bench_tisa_backends,
        "attention-checks": attention_checks,
        "orthogonal-step": bench_orthogonal_step,
        "orthogonal-shard": bench_orthogonal_shard,
        "cayley": bench_cayley,
        "transject-experts": bench_transject_experts,
        "tisa-bias-grad": bench_tisa_bias_grad,
        "objective": bench_objective,
        "eigen-products": bench_eigen_products,
        "norm-output": bench_norm_output,
        "kernel-mixing": bench_kernel_mixing,
    }[args.what]
    result = {"what": args.what, "args": {k: str(v) for k, v in vars(args).items()}}
    result.update(run(args))
    result["torch"] = torch.__version__
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print("wrote", args.out)


if __name__ == "__main__":
    main()
