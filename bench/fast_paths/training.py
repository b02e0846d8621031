"""Fast paths of the training step as a whole: the encoder compiled against eager
(`compile`), length-grouped fine-tuning batches (`grouping`), the loss terms compiled
(`objective`) and the LayerNorms' output dtype under autocast (`norm-output`)."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.nn.functional as F

from bench.common import time_interleaved
from bench.fast_paths import (
    autocast_for,
    make_batch,
    model_config,
    pretraining_step,
    sync,
    time_steps,
)
from model import EncoderForPretraining, EncoderForSequenceClassification


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

        timing = time_interleaved({name: epoch}, 1, args.repeats, args.device)[name]
        out[name] = {
            "batches": len(batches),
            "padding_share": 1 - real / computed,
            "tokens_computed": computed,
            "epoch_s": timing.median,
        }
        print(name, json.dumps(out[name]))
    out["epoch_speedup"] = out["shuffled"]["epoch_s"] / out["grouped"]["epoch_s"]
    print("speedup", out["epoch_speedup"])
    return out


def bench_objective(args) -> dict:
    """The pretraining objective's loss terms (`pretrain.objective.objective_terms`: MLM and SOP
    cross-entropies and the accuracy counts) on bf16 logits (batch, slots, vocab), forward +
    backward, eager vs compiled as the trainer compiles them beside the encoder
    (`Engine.compile_beside`), timed, and the bytes each moves counted (eager: every operator's
    inputs and outputs; compiled: Inductor's kernels, as `bench/traffic_per_token.py` counts
    them). Losses, counts and gradients checked equal."""
    from bench.traffic_per_token import InductorTraffic, counts_of, eager_traffic
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
