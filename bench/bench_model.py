"""Model step vs HF `transformers` ALBERT: forward + backward, same config, same weights, same run.

A random `transformers.AlbertForPreTraining` (ALBERT-base width, `--layers` shared layers) is saved
to a temp dir and imported through `model.hf_import`, so both models hold identical weights
(checked: logits agree). Each step computes the same loss on both (MLM cross-entropy over the
full logits + SOP) and its backward. Runs are interleaved (ours, theirs, ours, ...) and the
median is reported; the ratio is ours / theirs (<= 1.0 means we are at least as fast).

    python bench/bench_model.py --seq 128 512 --batch 8 --layers 4 --repeats 5 --out bench/results/model_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def build_pair(layers: int, vocab: int, device: str):
    from transformers import AlbertConfig, AlbertForPreTraining

    from model.hf_import import import_hf_albert

    hf_cfg = AlbertConfig(
        vocab_size=vocab,
        embedding_size=128,
        hidden_size=768,
        num_hidden_layers=layers,
        num_attention_heads=12,
        intermediate_size=3072,
        hidden_act="gelu_new",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
        max_position_embeddings=512,
    )
    theirs = AlbertForPreTraining(hf_cfg)
    with tempfile.TemporaryDirectory() as tmp:
        theirs.save_pretrained(tmp)
        ours = import_hf_albert(tmp)
    return ours.to(device).train(), theirs.to(device).train()


def step(model, is_hf: bool, ids, mask, labels, sop):
    if is_hf:
        out = model(input_ids=ids, attention_mask=mask)
        logits, sop_logits = out.prediction_logits, out.sop_logits
    else:
        out = model(ids, mask)
        logits, sop_logits = out.logits, out.sop_logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss = loss + F.cross_entropy(sop_logits, sop)
    loss.backward()
    return loss.detach()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=30000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ours, theirs = build_pair(args.layers, args.vocab, args.device)
    rows = []
    for n in args.seq:
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(5, args.vocab, (args.batch, n), generator=g).to(args.device)
        mask = torch.ones(args.batch, n, dtype=torch.long, device=args.device)
        labels = torch.where(torch.rand(ids.shape, generator=g).to(args.device) < 0.15, ids, -100)
        sop = torch.randint(0, 2, (args.batch,), generator=g).to(args.device)
        la = step(ours, False, ids, mask, labels, sop)
        lb = step(theirs, True, ids, mask, labels, sop)  # warm-up; also checks the losses agree
        assert torch.allclose(la, lb, atol=1e-4), f"losses differ: {la} vs {lb}"
        times = {"ours": [], "theirs": []}
        for _ in range(args.repeats):
            for name, model, is_hf in (("ours", ours, False), ("theirs", theirs, True)):
                model.zero_grad(set_to_none=True)
                if args.device != "cpu":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                step(model, is_hf, ids, mask, labels, sop)
                if args.device != "cpu":
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - start)
        ours_s, theirs_s = statistics.median(times["ours"]), statistics.median(times["theirs"])
        rows.append({"seq": n, "ours_s": ours_s, "theirs_s": theirs_s, "ratio": ours_s / theirs_s})
        print(rows[-1], flush=True)
    import transformers

    print(
        f"\nALBERT-base width, {args.layers} layers, batch {args.batch}, {args.device} fp32, "
        f"{args.threads} threads, torch {torch.__version__}, transformers {transformers.__version__}\n"
    )
    print("| seq | ours (s) | HF ALBERT (s) | ours / HF |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['seq']} | {r['ours_s']:.3f} | {r['theirs_s']:.3f} | {r['ratio']:.3f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2, default=str))


if __name__ == "__main__":
    main()
