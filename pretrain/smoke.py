"""Model smoke run: a few MLM + SOP steps of every attention family on the embedded corpus.

This is the README's main job until the full pipeline (data_prep -> DeepSpeed pretraining ->
export) lands with issues #3 and #4. It uses byte-level token ids (no tokenizer yet), trains each
family for a few steps on CPU, writes a release per family, reloads it and checks the logits
match, and prints losses and diagnostics.

    python -m pretrain.smoke --out runs/smoke [--steps 60] [--families softmax tisa ...]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from data_prep.corpus import embedded_documents
from model import ATTENTION_REGISTRY, EncoderConfig, EncoderForPretraining, diagnostics
from model.release import load_release, save_release

PAD, CLS, SEP, MASK, OFFSET = 0, 1, 2, 3, 4
VOCAB = 256 + OFFSET

FAMILY_OVERRIDES = {
    "softmax": {},
    "tisa": {"position_embedding": "none"},
    "kernel": {"kernel": {"feature_map": "aoglu", "dropout": 0.0}},
    "transject": {"transject": {"num_experts": 2, "residual_init": 1.0}},
}


def make_examples(seq_len: int, seed: int) -> list[tuple[list[int], list[int], int]]:
    """(ids, token types, SOP label): [CLS] A [SEP] B [SEP], A/B consecutive byte chunks of one doc."""
    rng = random.Random(seed)
    half = (seq_len - 3) // 2
    examples = []
    for doc in embedded_documents():
        data = [b + OFFSET for b in doc.encode("utf-8")]
        for start in range(0, len(data) - 2 * half, 2 * half):
            a, b = data[start : start + half], data[start + half : start + 2 * half]
            swapped = rng.random() < 0.5
            if swapped:
                a, b = b, a
            ids = [CLS, *a, SEP, *b, SEP]
            types = [0] * (len(a) + 2) + [1] * (len(b) + 1)
            examples.append((ids, types, int(swapped)))
    rng.shuffle(examples)
    return examples


def mask_batch(ids: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """15% of non-special tokens: 80% [MASK], 10% random byte, 10% unchanged. Returns (inputs, labels)."""
    special = ids < OFFSET
    picked = (torch.rand(ids.shape, generator=gen) < 0.15) & ~special
    labels = torch.where(picked, ids, torch.full_like(ids, -100))
    roll = torch.rand(ids.shape, generator=gen)
    inputs = ids.clone()
    inputs[picked & (roll < 0.8)] = MASK
    rand_tok = torch.randint(OFFSET, VOCAB, ids.shape, generator=gen)
    replace = picked & (roll >= 0.8) & (roll < 0.9)
    inputs[replace] = rand_tok[replace]
    return inputs, labels


def train_family(name: str, args, examples) -> dict:
    torch.manual_seed(args.seed)
    cfg = EncoderConfig.preset(
        "debug",
        vocab_size=VOCAB,
        hidden_size=64,
        embedding_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=args.seq_len,
        attention=name,
        **FAMILY_OVERRIDES.get(name, {}),
    )
    model = EncoderForPretraining(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        batch = [examples[(step * args.batch + i) % len(examples)] for i in range(args.batch)]
        ids = torch.tensor([b[0] for b in batch])
        types = torch.tensor([b[1] for b in batch])
        sop = torch.tensor([b[2] for b in batch])
        inputs, labels = mask_batch(ids, gen)
        out = model(inputs, torch.ones_like(ids, dtype=torch.bool), types)
        mlm = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss = (
            mlm
            + F.cross_entropy(out.sop_logits, sop)
            + sum(out.aux_losses.values(), torch.zeros(()))
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(mlm.item())
        if not torch.isfinite(loss):
            raise RuntimeError(f"{name}: non-finite loss at step {step}")
    seconds = time.perf_counter() - start

    release = save_release(Path(args.out) / name, model, overwrite=True)
    model.eval()
    reloaded = load_release(release).eval()
    probe = torch.tensor([examples[0][0]])
    with torch.no_grad():
        same = torch.equal(model(probe).logits, reloaded(probe).logits)
    if not same:
        raise RuntimeError(f"{name}: reloaded release gives different logits")
    ortho = diagnostics.orthogonality_errors(model)
    factors = diagnostics.activation_factors(model, probe)
    k = max(1, args.steps // 10)
    return {
        "family": name,
        "mlm_loss_first": sum(losses[:k]) / k,
        "mlm_loss_last": sum(losses[-k:]) / k,
        "seconds": round(seconds, 2),
        "parameters": sum(p.numel() for p in model.parameters()),
        "max_orthogonality_error": max(ortho.values()) if ortho else None,
        "activation_factor_last_layer": round(factors[-1].item(), 3),
        "release": str(release),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="runs/smoke", help="directory for the per-family releases")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--families", nargs="+", default=ATTENTION_REGISTRY.names())
    args = parser.parse_args(argv)
    unknown = [f for f in args.families if f not in ATTENTION_REGISTRY]
    if unknown:
        parser.error(f"unknown families {unknown}; valid: {ATTENTION_REGISTRY.names()}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    examples = make_examples(args.seq_len, args.seed)
    print(f"embedded corpus: {len(examples)} examples of {args.seq_len} byte tokens")
    rows = [train_family(name, args, examples) for name in args.families]
    print(
        f"\n{'family':<10} {'mlm first':>10} {'mlm last':>10} {'sec':>6} {'params':>8} {'orth err':>9}"
    )
    for r in rows:
        err = "-" if r["max_orthogonality_error"] is None else f"{r['max_orthogonality_error']:.1e}"
        print(
            f"{r['family']:<10} {r['mlm_loss_first']:>10.3f} {r['mlm_loss_last']:>10.3f} "
            f"{r['seconds']:>6.1f} {r['parameters']:>8} {err:>9}"
        )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(f"\nreleases and summary.json in {args.out}")
    failed = [r["family"] for r in rows if not r["mlm_loss_last"] < r["mlm_loss_first"]]
    if failed:
        print(f"MLM loss did not decrease for: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
