"""The fast paths' benchmarks (``python -m bench.bench_fast_paths <what>``), by subject:
``training`` (compile, grouping, objective, norm-output), ``tisa`` (tisa, tisa-backends),
``transject`` (the orthogonal maps, Cayley, eigen-products), ``kernel`` (kernel-mixing). Here:
the small models and batches they share."""

from __future__ import annotations

import contextlib

import torch

from bench.common import median_seconds as time_steps
from bench.common import sync
from model import EncoderConfig

__all__ = [
    "FAMILY_OVERRIDES", "autocast_for", "first_line", "kernel_options", "make_batch",
    "model_config", "orthogonal_matrix_count", "pretraining_step", "sync", "time_steps",
]  # fmt: skip


FAMILY_OVERRIDES = {
    "softmax": {},
    "tisa": {"position_embedding": "none"},
    "kernel": {"kernel": {"feature_map": "aoglu", "dropout": 0.0}},
    "transject": {"transject": {"num_experts": 4}},
}


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


def first_line(error: Exception) -> str:
    """An exception's message, its first line (Inductor's run to many)."""
    return str(error).strip().splitlines()[0]
