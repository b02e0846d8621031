"""TISA's fast paths: its step against softmax's (`tisa`), and its mixing step per backend
and length (`tisa-backends`: FlexAttention, SDPA with the materialised bias, the split
backend's Triton kernels)."""

from __future__ import annotations

import json
import platform

import torch
import torch.nn.functional as F

from bench.fast_paths import (
    autocast_for,
    first_line,
    kernel_options,
    make_batch,
    model_config,
    pretraining_step,
    time_steps,
)
from model import EncoderForPretraining


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


def split_kernel_options(backend: str):
    """`split:BLOCK:WARPS:STAGES` -> those `SPLIT_KERNEL_OPTIONS` while the block runs."""
    from model.attention import tisa_split

    return kernel_options(tisa_split.SPLIT_KERNEL_OPTIONS, backend, "BLOCK")


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
