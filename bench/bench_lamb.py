"""The LAMB step on a recipe's parameters: ours (``engine.lamb.Lamb``) as the engine runs it
(``skip`` a device tensor: a step that may be skipped without asking the host), the same with its
arithmetic compiled (``optimizer.implementation: compiled``; the warm-up steps include the
compilation), ours as a plain optimizer (``skip`` None), and the reference per-tensor LAMB it is
checked against (``pytorch_optimizer.Lamb``, ``weight_decouple=False``, ``adam_debias=True``: the
same formula).

The parameters have the shapes of the recipe's model (built on the meta device, then
materialised with random values), the gradients are random and fixed; each variant owns a copy
of them and its own state; the variants' steps are interleaved, median of ``--repeats`` after
``--warmup``. On CUDA, device time (CUDA events); on the CPU, host time.

    python -m bench.bench_lamb --recipe albert-base-transject --device cpu --threads 2
    python -m bench.bench_lamb --recipe albert-base albert-base-transject --device cuda
    python -m bench.bench_lamb --traffic --recipe albert-base albert-base-transject  # bytes/param
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.common import ROOT, time_interleaved, write_result

VARIANTS = ("ours_skippable", "ours_compiled", "ours_plain", "pytorch_optimizer")


def recipe_shapes(recipe: str) -> list[torch.Size]:
    from engine.recipe import load_recipe
    from model.heads import EncoderForPretraining
    from pretrain.config import pretrain_config

    cfg = pretrain_config(load_recipe(ROOT / "configs/pretrain" / f"{recipe}.yaml", []))
    with torch.device("meta"):
        model = EncoderForPretraining(cfg.encoder_config(30000, 0))
    return [p.shape for p in model.parameters()]


def make_optimizer(variant: str, params: list[torch.nn.Parameter]):
    lr, wd = 1.76e-3, 0.01
    if variant == "pytorch_optimizer":
        from pytorch_optimizer import Lamb as Reference

        return Reference(params, lr=lr, weight_decay=wd, weight_decouple=False, adam_debias=True)
    from engine.lamb import Lamb

    opt = Lamb(params, lr=lr, weight_decay=wd, compiled=variant == "ours_compiled")
    if variant in ("ours_skippable", "ours_compiled"):
        opt.skip = torch.tensor(False, device=params[0].device)
    return opt


def bench_recipe(recipe: str, args) -> dict:
    device = torch.device(args.device)
    shapes = recipe_shapes(recipe)
    g = torch.Generator(device="cpu").manual_seed(0)
    values = [torch.randn(s, generator=g) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=g) * 1e-3 for s in shapes]
    optimizers = {}
    for variant in args.variants:
        params = [torch.nn.Parameter(v.to(device, copy=True)) for v in values]
        for p, grad in zip(params, grads):
            p.grad = grad.to(device, copy=True)
        optimizers[variant] = make_optimizer(variant, params)
    timings = time_interleaved(
        {variant: opt.step for variant, opt in optimizers.items()},
        args.warmup,
        args.repeats,
        device.type,
        device_time=True,
    )
    ms = {v: t.median * 1e3 for v, t in timings.items()}
    first = [p.detach().cpu() for p in optimizers[args.variants[0]].param_groups[0]["params"]]
    differences = {}
    for variant in args.variants[1:]:
        other = [p.detach().cpu() for p in optimizers[variant].param_groups[0]["params"]]
        differences[variant] = max(float((a - b).abs().max()) for a, b in zip(first, other))
    row = {
        "recipe": recipe,
        "tensors": len(shapes),
        "parameters": sum(s.numel() for s in shapes),
        "ms": ms,
        f"largest_weight_difference_vs_{args.variants[0]}": differences,
    }
    print(json.dumps(row), flush=True)
    return row


def count_traffic(recipe: str) -> dict:
    """Bytes moved per parameter by one step of ours as the engine runs it (``skip`` set),
    eagerly (every operator's tensor inputs and outputs, bench/traffic_per_token.py's count)
    and compiled (the bytes of the kernels Inductor generates, by its scheduler's estimate);
    on the CPU, no timing: the same operators a GPU runs, the compiled kernels the CPU's."""
    import torch._dynamo

    import engine.lamb
    from bench.traffic_per_token import InductorTraffic, eager_traffic

    shapes = recipe_shapes(recipe)
    numel = sum(s.numel() for s in shapes)
    g = torch.Generator(device="cpu").manual_seed(0)
    values = [torch.randn(s, generator=g) * 0.02 for s in shapes]
    row: dict = {"recipe": recipe, "tensors": len(shapes), "parameters": numel}
    for variant in ("ours_skippable", "ours_compiled"):
        params = [torch.nn.Parameter(v.clone()) for v in values]
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        opt = make_optimizer(variant, params)
        torch._dynamo.reset()
        engine.lamb._compiled.cache_clear()
        if variant == "ours_compiled":  # the first step compiles: its kernels are counted
            with InductorTraffic("step") as traffic:
                opt.step()
        else:
            opt.step()  # the moments made (zeros) outside the count
            with eager_traffic() as traffic:
                opt.step()
        row[f"{variant}_bytes_per_parameter"] = traffic.bytes.get("memory", 0) / numel
        row[f"{variant}_kernels"] = sum(traffic.ops.values())
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--recipe", nargs="+", default=["albert-base", "albert-base-transject"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument(
        "--traffic",
        action="store_true",
        help="count the bytes moved per parameter (eager vs compiled) instead of timing",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.traffic:
        rows = [count_traffic(recipe) for recipe in args.recipe]
        write_result(args.out, {"args": vars(args), "rows": rows})
        return
    rows = [bench_recipe(recipe, args) for recipe in args.recipe]
    print(f"\nLAMB step, {args.device}, torch {torch.__version__}; ms (median of {args.repeats})\n")
    print("| recipe | tensors | parameters | " + " | ".join(args.variants) + " |")
    print("|---|---|---|" + "---|" * len(args.variants))
    for r in rows:
        cells = " | ".join(f"{r['ms'][v]:.1f}" for v in args.variants)
        print(f"| {r['recipe']} | {r['tensors']} | {r['parameters'] / 1e6:.1f}M | {cells} |")
    write_result(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
