"""TransJect's fast paths: the Cayley map by block inverse against LU and torch's
parametrization (`cayley`), the orthogonal maps kept across inference forwards
(`orthogonal-cache`), once per optimizer step (`orthogonal-step`) and sharded over the ranks
(`orthogonal-shard`), and the eigen-state's products (`eigen-products`)."""

from __future__ import annotations

import json
import sys

import torch

from bench.common import subprocess_env
from bench.fast_paths import (
    autocast_for,
    make_batch,
    model_config,
    orthogonal_matrix_count,
    pretraining_step,
    time_steps,
)
from model import EncoderConfig, EncoderForPretraining


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
    from bench.traffic_per_token import counts_of, eager_traffic

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
    weights) with the boolean model option `option` off and on, through the engine: torch
    backend, the recipes' foreach LAMB, `--accumulation` micro-batches of `--batch`; with
    `--compiled`, `engine.compile` (`--compile-backend`)."""
    from engine.engine import Engine, EngineConfig
    from engine.optim import OptimizerConfig, ScheduleConfig

    engines = {}
    for on in (False, True):
        torch.manual_seed(0)
        maps = {option: on, "orthogonal_shard_min_size": args.shard_min_size}
        model = EncoderForPretraining(model_config("transject", args, **maps))
        cfg = EngineConfig(
            backend="torch",
            device=args.device,
            precision="bf16-mixed" if args.dtype == "bf16" else "fp32",
            micro_batch_size=args.batch,
            gradient_accumulation_steps=args.accumulation,
            gradient_clipping=1.0,
            compile=args.compiled,
            compile_backend=args.compile_backend,
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


def race(engines: dict, names: tuple[str, str], ids, mask, args) -> tuple[dict, dict]:
    """The engines' steps interleaved, `names` for off and on: ({name: median seconds per
    optimizer step}, a result row: the batch, each one's milliseconds, the speed-up of on over
    off and the largest difference between the two engines' weights afterwards)."""
    off, on = names
    t = time_steps(
        {
            off: optimizer_step(engines[False], ids, mask),
            on: optimizer_step(engines[True], ids, mask),
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
    row = {"seq": ids.shape[1], "batch": args.batch, "accumulation": args.accumulation}
    row.update({f"{off}_ms": 1e3 * t[off], f"{on}_ms": 1e3 * t[on], "speedup": t[off] / t[on]})
    return t, {**row, "max_weight_difference": diff}


def bench_orthogonal_step(args) -> dict:
    """A TransJect training step with gradient accumulation (`--accumulation` micro-batches of
    `--batch` x N, forward + backward each, then the optimizer step) through the engine (torch
    backend, the recipes' foreach LAMB), with the orthogonal maps evaluated once per step
    (`model.orthogonal_step_cache`, the default) vs once per micro-batch; two engines from the
    same initial weights, steps interleaved. Also checks that they stay equal (the largest
    weight difference after all the timed steps)."""
    from engine.distributed import DistEnv

    rows = []
    for N in args.seq:
        ids, mask = make_batch(args, N, args.device)
        engines = transject_engines(args, DistEnv.single(), "orthogonal_step_cache")
        maps = orthogonal_matrix_count(engines[True].module)

        t, row = race(engines, ("per_micro_batch", "per_step"), ids, mask, args)
        row.update(compiled=args.compiled, maps_per_forward=maps)
        row["saved_per_micro_batch_ms"] = (
            1e3 * (t["per_micro_batch"] - t["per_step"]) / (args.accumulation - 1)
            if args.accumulation > 1
            else None  # nothing to share: the two engines are the same (a step's time)
        )
        rows.append(row)
        print(json.dumps(row))
    return {"rows": rows}


def maps_alone(model, sharding, args) -> dict[str, float]:
    """All of `model`'s orthogonal maps, forward + backward, as one training micro-batch maps
    them: every rank all of them, sharded, and the sharded collectives alone (the gather of
    the shares and its backward, on the free parameters instead of their maps)."""
    from model.orthogonal import evaluate_orthogonal_maps
    from model.orthogonal_step import OrthogonalStepCache

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
    over the ranks (`model.orthogonal_shard_maps`, the default) vs every rank mapping all of
    them; `--accumulation` micro-batches per step (default 1: no step cache to share the maps
    over micro-batches). Two engines from the same initial weights, steps interleaved, each
    rank on its own batch; rank 0 reports, with the largest weight difference after all timed
    steps. Relaunches itself under torchrun when started without it."""
    import os
    import subprocess

    if "RANK" not in os.environ:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={args.ranks}", "-m", "bench.bench_fast_paths", *sys.argv[1:],
        ]  # fmt: skip
        subprocess.run(cmd, check=True, env=subprocess_env())
        args.out = None  # rank 0 of the launched job wrote it
        return {"launched": cmd}

    from engine.distributed import detect
    from engine.engine import shutdown
    from model.orthogonal_step import OrthogonalMapHooks

    dist = detect()
    device = f"cuda:{dist.local_rank}" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(dist.local_rank)
    rows = []
    for N in args.seq:
        ids, mask = make_batch(args, N, device)
        ids = (ids + dist.rank) % args.vocab  # each rank its own batch
        engines = transject_engines(args, dist, "orthogonal_shard_maps")
        _, row = race(engines, ("every_rank_all_maps", "sharded"), ids, mask, args)
        (hooks,) = [h for h in engines[True].step_hooks if isinstance(h, OrthogonalMapHooks)]
        steps = hooks.steps
        mapped = steps.evaluations / (args.warmup + args.repeats) if steps is not None else None
        maps = maps_alone(engines[True].module, steps.sharding, args)
        row.update(ranks=dist.world_size, maps_per_step_rank0_sharded=mapped)
        row.update({f"maps_alone_{k}_ms": 1e3 * v for k, v in maps.items()})
        rows.append(row)
        if dist.rank == 0:
            print(json.dumps(row))
        del engines
    shutdown()
    if dist.rank != 0:
        args.out = None  # rank 0 writes the report
    return {"rows": rows}


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
