"""Model step vs HF `transformers` ALBERT: forward + backward, same config, same weights, same run.

A random `transformers.AlbertForPreTraining` (ALBERT-base width, `--layers` shared layers) is saved
to a temp dir and imported through `model.hub.hf_import`, so both models hold identical weights
(checked: the fp32 losses agree before anything is timed). Each step computes the same loss on
both (MLM cross-entropy over the full logits + SOP) and its backward. Runs are interleaved (ours,
theirs, ours, ...) and the median is reported; the ratio is ours / theirs (<= 1.0 means we are at
least as fast). The batch holds no padding and reaches each model as its own pipeline hands
it over: HF gets an all-ones `attention_mask` (transformers checks it on the host and drops it,
so SDPA may pick flash); ours gets None, what the trainers' `Engine.to_device` makes of such a
mask while it is still on the host. (Runs before this used the all-ones mask on the device for
ours too, which the model must treat as padded: SDPA with a key-padding bias, not flash.)

Precision (`--dtype`): `fp32`, or `bf16` = `torch.autocast(dtype=torch.bfloat16)` around forward
and loss with fp32 weights and gradients on both sides (the engine's `bf16-mixed`), so both models
do the same mixed-precision work: our LayerNorms return fp32 under autocast here, as HF's do
(`--norm-output fp32`, the default of this benchmark); `--norm-output compute` times ours as the
recipes run it (`model.norm_output: compute`, LayerNorms returning bf16: less work than HF's).
On CUDA each step is timed with CUDA events after `--warmup` untimed steps (median of
`--repeats`), and the peak memory of one step is
`torch.cuda.max_memory_allocated()` after a reset, minus what was allocated before the step.

    python -m bench.bench_model --seq 128 512 --batch 8 --layers 4 --repeats 5 --out bench/results/model_cpu.json
    python -m bench.bench_model --device cuda --dtype bf16 --seq 128 512 --batch 32 --layers 12 --repeats 20 --out model_gpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import write_result
from engine.engine import batch_to_device
from model.norm import LayerNorm


def build_pair(layers: int, vocab: int, device: str):
    from transformers import AlbertConfig, AlbertForPreTraining

    from model.hub.hf_import import import_hf_albert

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


def step(model, is_hf: bool, ids, masks, labels, sop, autocast=None):
    with autocast if autocast is not None else contextlib.nullcontext():
        if is_hf:
            out = model(input_ids=ids, attention_mask=masks["hf"])
            logits, sop_logits = out.prediction_logits, out.sop_logits
        else:
            out = model(ids, masks["ours"])
            logits, sop_logits = out.logits, out.sop_logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss = loss + F.cross_entropy(sop_logits.float(), sop)
    loss.backward()
    return loss.detach()


def timed_step(model, is_hf, inputs, device: str, autocast) -> tuple[float, float | None]:
    """(seconds, peak MB of the step above what was allocated before it; None on CPU)."""
    model.zero_grad(set_to_none=True)
    if device == "cpu":
        start = time.perf_counter()
        step(model, is_hf, *inputs, autocast=autocast)
        return time.perf_counter() - start, None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    step(model, is_hf, *inputs, autocast=autocast)
    end.record()
    torch.cuda.synchronize()
    peak_mb = (torch.cuda.max_memory_allocated() - before) / 2**20
    return begin.elapsed_time(end) / 1e3, peak_mb


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=30000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per model and "
                        "length before timing (default: 1 on CPU, 3 on CUDA)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument(
        "--norm-output",
        default="fp32",
        choices=["fp32", "compute"],
        help="our LayerNorms' output under bf16 autocast (model.norm_output): fp32 as HF's "
        "(like for like, the default here) or compute (bf16, as the recipes run)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    warmup = args.warmup if args.warmup is not None else (1 if args.device == "cpu" else 3)
    ours, theirs = build_pair(args.layers, args.vocab, args.device)
    for module in ours.modules():  # model.norm_output, set on the imported model's LayerNorms
        if isinstance(module, LayerNorm):
            module.autocast_output = args.norm_output
    autocast = (
        torch.autocast(device_type=args.device, dtype=torch.bfloat16)
        if args.dtype == "bf16"
        else None
    )
    rows = []
    for n in args.seq:
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(5, args.vocab, (args.batch, n), generator=g).to(args.device)
        # An unpadded batch as each side's own pipeline hands it to its model: HF gets the
        # all-ones attention_mask (transformers reads it, a host sync, and drops it, so SDPA may
        # use flash); ours gets what the trainers' Engine.to_device makes of it (read on the
        # host before the copy): None, so the attention knows without a sync.
        mask = torch.ones(args.batch, n, dtype=torch.long)
        masks = {
            "hf": mask.to(args.device),
            "ours": batch_to_device({"attention_mask": mask}, args.device)["attention_mask"],
        }
        labels = torch.where(torch.rand(ids.shape, generator=g).to(args.device) < 0.15, ids, -100)
        sop = torch.randint(0, 2, (args.batch,), generator=g).to(args.device)
        inputs = (ids, masks, labels, sop)
        # Same weights -> same fp32 loss (TF32 off for the check, so it is exact to rounding).
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        la = step(ours, False, *inputs)
        lb = step(theirs, True, *inputs)
        torch.backends.cuda.matmul.allow_tf32 = tf32
        assert torch.allclose(la, lb, atol=1e-4), f"fp32 losses differ: {la} vs {lb}"
        if autocast is not None:
            la, lb = step(ours, False, *inputs, autocast), step(theirs, True, *inputs, autocast)
            assert torch.allclose(la, lb, rtol=2e-2), f"bf16 losses differ: {la} vs {lb}"
        for _ in range(warmup):
            for model, is_hf in ((ours, False), (theirs, True)):
                timed_step(model, is_hf, inputs, args.device, autocast)
        times: dict[str, list[float]] = {"ours": [], "theirs": []}
        peaks: dict[str, list[float]] = {"ours": [], "theirs": []}
        for _ in range(args.repeats):
            for name, model, is_hf in (("ours", ours, False), ("theirs", theirs, True)):
                seconds, peak = timed_step(model, is_hf, inputs, args.device, autocast)
                times[name].append(seconds)
                if peak is not None:
                    peaks[name].append(peak)
        ours_s, theirs_s = statistics.median(times["ours"]), statistics.median(times["theirs"])
        row = {"seq": n, "ours_s": ours_s, "theirs_s": theirs_s, "ratio": ours_s / theirs_s}
        if peaks["ours"]:
            row["ours_peak_mb"] = max(peaks["ours"])
            row["theirs_peak_mb"] = max(peaks["theirs"])
        row["loss_ours"], row["loss_theirs"] = float(la), float(lb)
        rows.append(row)
        print(row, flush=True)
    import transformers

    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{args.threads} threads"
    attn = getattr(theirs.config, "_attn_implementation", "?")
    print(
        f"\nALBERT-base width, {args.layers} layers, batch {args.batch}, {args.device} "
        f"{args.dtype}{' autocast' if args.dtype == 'bf16' else ''}"
        f"{f' (our LayerNorms return {args.norm_output})' if args.dtype == 'bf16' else ''}, "
        f"{where}, HF attention "
        f"{attn}, torch {torch.__version__}, transformers {transformers.__version__}\n"
    )
    mem = args.device == "cuda"
    print(
        "| seq | ours (s) | HF ALBERT (s) | ours / HF |"
        + (" peak MB ours / HF |" if mem else "")
        + "\n|---|---|---|---|"
        + ("---|" if mem else "")
    )
    for r in rows:
        extra = f" {r['ours_peak_mb']:.0f} / {r['theirs_peak_mb']:.0f} |" if mem else ""
        print(f"| {r['seq']} | {r['ours_s']:.4f} | {r['theirs_s']:.4f} | {r['ratio']:.3f} |{extra}")
    if args.out:
        meta = {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device_name": where,
            "hf_attn_implementation": attn,
            "warmup": warmup,
        }
        write_result(args.out, {"args": vars(args), "meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
