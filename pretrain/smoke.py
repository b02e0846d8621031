"""Smoke run of the pipeline: data_prep on the embedded corpus, then a few MLM + SOP steps of
every attention family fed by the real training loader.

This is the README's main job until DeepSpeed pretraining and export land (issue #4):

    1. `data_prep tokenizer`: a SentencePiece-unigram tokenizer trained on the embedded corpus
       (CPython's own documentation text, so nothing is downloaded);
    2. `data_prep shards`: ALBERT sentence-pair examples in memory-mapped shards + manifest;
    3. for each attention family: a small encoder trained for a few steps with the training
       loader (dynamic n-gram masking, SOP), a release written with the tokenizer, reloaded,
       and its logits checked; losses and diagnostics printed.

    python -m pretrain.smoke --out runs/smoke [--steps 60] [--families softmax tisa ...]

Re-running reuses the tokenizer and the finished shards (data_prep resumes); the per-family
releases are rewritten.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from data_prep.format import TOKENIZER
from data_prep.loader import PretrainingData, PretrainingLoader
from data_prep.shards import ShardConfig, build_shards
from data_prep.tokenizer import write_tokenizer
from model import ATTENTION_REGISTRY, EncoderConfig, EncoderForPretraining, diagnostics
from model.release import load_release, save_release

FAMILY_OVERRIDES = {
    "softmax": {},
    "tisa": {"position_embedding": "none"},
    "kernel": {"kernel": {"feature_map": "aoglu", "dropout": 0.0}},
    "transject": {"transject": {"num_experts": 2, "residual_init": 1.0}},
}


def prepare_data(args) -> tuple[Path, Path]:
    """Tokenizer + shards on the embedded corpus (both reused when already there)."""
    out = Path(args.out)
    tok_path = out / "tokenizer" / TOKENIZER
    if not tok_path.exists():
        write_tokenizer(out / "tokenizer", inputs=["embedded"], vocab_size=args.vocab_size)
    shard_dir = out / "shards"
    config = ShardConfig(
        inputs=("embedded",), num_shards=2, max_seq_length=args.seq_len, seed=args.seed
    )
    build_shards(config, tok_path, shard_dir, workers=1)
    return tok_path, shard_dir


def train_family(name: str, args, tok_path: Path, shard_dir: Path) -> dict:
    torch.manual_seed(args.seed)
    data = PretrainingData(
        shard_dir, max_seq_length=args.seq_len, seed=args.seed, tokenizer_path=tok_path
    )
    loader = PretrainingLoader(data, batch_size=args.batch, num_workers=0)
    cfg = EncoderConfig.preset(
        "debug",
        vocab_size=data.vocab_size,
        hidden_size=64,
        embedding_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=args.seq_len,
        pad_token_id=data.special.pad,
        attention=name,
        **FAMILY_OVERRIDES.get(name, {}),
    )
    model = EncoderForPretraining(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    losses, start = [], time.perf_counter()
    batches = iter(loader)
    for step in range(args.steps):
        batch = next(batches)
        out = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        mlm = F.cross_entropy(
            out.logits.flatten(0, 1), batch["mlm_labels"].flatten(), ignore_index=-100
        )
        sop = F.cross_entropy(out.sop_logits, batch["sop_labels"], ignore_index=-100)
        loss = mlm + sop + sum(out.aux_losses.values(), torch.zeros(()))
        if not torch.isfinite(loss):
            raise RuntimeError(f"{name}: non-finite loss at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(mlm.item())
    seconds = time.perf_counter() - start

    release = save_release(
        Path(args.out) / "releases" / name, model, tokenizer_file=tok_path, overwrite=True
    )
    model.eval()
    reloaded = load_release(release).eval()
    probe = next(batches)["input_ids"][:1]
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
    parser.add_argument(
        "--out", default="runs/smoke", help="directory for tokenizer, shards, releases"
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--vocab-size", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--families", nargs="+", default=ATTENTION_REGISTRY.names())
    args = parser.parse_args(argv)
    unknown = [f for f in args.families if f not in ATTENTION_REGISTRY]
    if unknown:
        parser.error(f"unknown families {unknown}; valid: {ATTENTION_REGISTRY.names()}")
    start = time.perf_counter()
    tok_path, shard_dir = prepare_data(args)
    manifest = json.loads((shard_dir / "manifest.json").read_text())
    print(
        f"data_prep: tokenizer {tok_path} (vocab {manifest['vocab_size']}), "
        f"{manifest['totals']['examples']} examples / {manifest['totals']['tokens']} tokens "
        f"in {manifest['num_shards']} shards at {shard_dir} ({time.perf_counter() - start:.1f} s)"
    )
    rows = [train_family(name, args, tok_path, shard_dir) for name in args.families]
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
    print(
        f"\nreleases in {Path(args.out) / 'releases'}, summary in {Path(args.out) / 'summary.json'}"
    )
    failed = [r["family"] for r in rows if not r["mlm_loss_last"] < r["mlm_loss_first"]]
    if failed:
        print(f"MLM loss did not decrease for: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
