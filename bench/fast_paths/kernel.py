"""Kernel attention's training mixing (`kernel-mixing`): the torch operators, eager and
compiled, against the Triton operator (`kernel.training_backend: triton`), beside softmax's
SDPA, with the activation memory each keeps."""

from __future__ import annotations

import argparse
import json
import platform

import torch
import torch.nn.functional as F

from bench.fast_paths import autocast_for, kernel_options, model_config, time_steps


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
