"""Does TransJect's eigen-approximation train? The eigenbasis error of U per reconstruction loss.

A 2-layer TransJect classifier (d = 64, 2 experts, vocab 20, 100 tokens, 10 classes, label =
(token 1 + token 5) mod 10) trained with AdamW (lr 1e-3, no weight decay, batch 32) for 200 steps
with each reconstruction loss at the authors' classification weight 1e-3, and with none. Every 50
steps: the eigenbasis error ||offdiag(U^T M U)||^2 / ||M||^2 of the current batch (0 when U is an
eigenbasis of M = X0^T X0). docs/methods.md quotes its output:

    python bench/bench_transject_reconstruction.py        # seconds to minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from model.attention.transject import eigenbasis_error
from model.config import EncoderConfig
from model.heads import EncoderForSequenceClassification

CASES = (("scale_free", 1e-3), ("authors", 1e-3), ("scale_free", 0.0))


def run(reconstruction: str, weight: float, steps: int, every: int) -> list[float]:
    torch.manual_seed(0)
    cfg = EncoderConfig.from_dict(
        {
            "preset": "debug",
            "hidden_size": 64,
            "embedding_size": 64,
            "num_hidden_layers": 2,
            "num_hidden_groups": 2,
            "num_attention_heads": 2,
            "intermediate_size": 128,
            "vocab_size": 20,
            "attention": "transject",
            "transject": {
                "num_experts": 2,
                "reconstruction": reconstruction,
                "reconstruction_weight": weight,
            },
        }
    )
    model = EncoderForSequenceClassification(cfg, num_labels=10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    errors = []
    for step in range(steps + 1):
        ids = torch.randint(1, 20, (32, 100), generator=g)
        mask = torch.ones_like(ids, dtype=torch.bool)
        if step % every == 0:
            with torch.no_grad():
                x0 = model.encoder.embeddings(ids)
                basis = model.encoder.family_state.eigenbasis
                errors.append(round(eigenbasis_error(x0, mask, basis).mean().item(), 3))
        if step == steps:
            break
        out = model(ids, mask)
        loss = F.cross_entropy(out.logits, (ids[:, 1] + ids[:, 5]) % 10)
        loss = loss + sum(out.aux_losses.values(), torch.zeros(()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=50)
    args = parser.parse_args()
    rows = []
    for reconstruction, weight in CASES:
        start = time.perf_counter()
        errors = run(reconstruction, weight, args.steps, args.every)
        rows.append({"reconstruction": reconstruction, "weight": weight, "errors": errors})
        took = time.perf_counter() - start
        print(f"{reconstruction:<10} weight {weight:<6g} eigenbasis error {errors}  ({took:.0f} s)")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
