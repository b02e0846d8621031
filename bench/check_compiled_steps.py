"""Where a compiled training step stops being finite: the same recipe and batches, eager and
under each ``torch.compile`` backend, step by step, with every loss part, the model's outputs
and the gradient of every parameter checked for non-finite values.

A diagnostic for the GPU suite (part ``compilecheck``), not a benchmark: it synchronises after
every step. It was written because the TransJect recipes compiled with inductor skipped every
step as non-finite on an H200 while eager skipped none (BENCHMARKS.md) and the CPU did not
reproduce it; with the maps by block inverse and the batched expert block, the same check on
an H100 found every step finite (inductor within 1.4e-7 of eager). Each mode builds the engine
afresh from the recipe (the same seed, so the same initial weights) through
``bench_pretrain_throughput.Measurement`` (DeepSpeed, ZeRO-0, ``bf16-mixed`` on CUDA, the
recipe's LAMB), runs ``--steps`` steps on the same synthetic
batches, and reports per step:

* ``loss``: each part (``mlm``, ``sop``, ``aux/...``) and whether it is finite;
* ``outputs``: the largest |value| of the MLM logits, the SOP logits and the final hidden
  state, and whether each is finite (a non-finite forward shows up here; a finite forward with
  non-finite gradients points at the backward);
* ``nonfinite_grads``: how many parameters have a non-finite gradient, and the first names in
  the model's order (which layer, which projection);
* ``grad_norm``, ``skipped``: what the engine decided.

Then the first step's loss parts of each compiled mode against eager (relative difference).

When the whole-encoder ``inductor`` mode has a non-finite step, two scoped modes follow (unless
``--no-bisect``), each compiling only part of the eager encoder in place with inductor:
``inductor-layers`` (every distinct layer module) and ``inductor-state`` (the embeddings and the
family's once-per-forward state, e.g. TransJect's eigenvalues); which of them goes non-finite
says where inductor's code differs. Either can also be asked for in ``--modes``.

    python bench/check_compiled_steps.py --device cuda --family transject --out compile_check.json
    python bench/check_compiled_steps.py --device cpu --base debug --seq 64 --batch 4  # setup check
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
MODES = ("eager", "aot_eager", "inductor")
SCOPED = ("inductor-layers", "inductor-state")


def compile_scope(encoder, scope: str) -> list[str]:
    """Compiles part of an eager encoder in place with inductor (`nn.Module.compile`): "layers",
    each distinct layer module once; "state", the embeddings and the family state. Returns
    the names of what was compiled."""
    if scope == "layers":  # the distinct layers: those of the encoder's groups
        targets = [layer for group in encoder.groups for layer in group]
    else:
        targets = [m for m in (encoder.embeddings, getattr(encoder, "family_state", None)) if m]
    names = [n for n, m in encoder.named_modules() if any(m is t for t in targets)]
    for module in targets:
        module.compile(backend="inductor")
    return names


def _summary(t) -> dict:
    """Largest |value| of a tensor and whether every value is finite (synchronises)."""
    t = t.detach().float()
    return {"max_abs": float(t.abs().max()), "finite": bool(t.isfinite().all())}


def run_mode(mode: str, args) -> dict:
    """``--steps`` checked steps of one engine: eager, or compiled with backend ``mode``."""
    import torch
    import torch._dynamo
    from bench_pretrain_throughput import Measurement

    from pretrain.objective import model_inputs, pretraining_loss

    torch._dynamo.reset()
    scoped = mode in SCOPED
    extra = {"engine.compile": mode not in ("eager", *SCOPED)}
    if extra["engine.compile"]:
        extra["engine.compile_backend"] = mode
    m = Measurement(mode, args.base, args.family, args.seq, args.batch, args.vocab, args, extra)
    engine = m.engine
    compiled = []
    if scoped:
        compiled = compile_scope(engine.module.encoder, mode.split("-", 1)[1])
        print(f"{mode}: compiled {compiled}", flush=True)
    steps = []
    for i in range(args.steps):
        batch = engine.to_device(m.batches[i % len(m.batches)])
        out = engine.forward(**model_inputs(batch, m.max_masked))
        loss = pretraining_loss(out, batch)
        engine.backward(loss.total, defer=True)
        bad = [
            n
            for n, p in engine.module.named_parameters()
            if p.grad is not None and not bool(p.grad.isfinite().all())
        ]
        result = engine.step(defer=True).resolve()
        parts = {k: float(v) for k, v in loss.parts.items()}
        outputs = {"logits": _summary(out.logits), "sop_logits": _summary(out.sop_logits)}
        if out.encoder is not None:
            outputs["last_hidden_state"] = _summary(out.encoder.last_hidden_state)
        steps.append(
            {
                "step": i + 1,
                "loss": parts,
                "loss_finite": all(math.isfinite(v) for v in parts.values()),
                "outputs": outputs,
                "nonfinite_grads": len(bad),
                "first_nonfinite_grads": bad[:12],
                "grad_norm": result.grad_norm,
                "skipped": result.skipped,
            }
        )
        s = steps[-1]
        print(
            f"{mode} step {s['step']}: loss "
            + ", ".join(f"{k}={v:.4g}" for k, v in parts.items())
            + f"; outputs finite {all(o['finite'] for o in outputs.values())}; "
            f"{len(bad)} non-finite grads{(' ' + str(bad[:3])) if bad else ''}; "
            f"grad norm {result.grad_norm}; skipped {result.skipped}",
            flush=True,
        )
    del m, engine
    return {"mode": mode, "steps": steps, **({"compiled": compiled} if scoped else {})}


def main() -> None:
    from bench_pretrain_throughput import add_single_point_args, finish_single_point_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_single_point_args(p)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES + SCOPED)
    p.add_argument(
        "--no-bisect",
        action="store_true",
        help="no scoped inductor modes after a non-finite whole-encoder inductor run",
    )
    p.add_argument("--override", nargs="*", default=[], help="recipe overrides key=value")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    finish_single_point_args(args)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "modes": []}
    modes = list(args.modes)
    for mode in modes:
        try:
            report["modes"].append(run_mode(mode, args))
        except Exception as e:  # a mode that fails to build or compile: say so, go on
            report["modes"].append({"mode": mode, "error": f"{type(e).__name__}: {e}"[:1000]})
            print(f"{mode}: {type(e).__name__}: {e}"[:1000], flush=True)
        if args.out:  # what is done survives a kill
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2))
        steps = report["modes"][-1].get("steps") or []
        nonfinite = any(st["skipped"] or not st["loss_finite"] for st in steps)
        if mode == "inductor" and nonfinite and not args.no_bisect:
            modes += [m for m in SCOPED if m not in modes]  # where, then
    first = {r["mode"]: r["steps"][0]["loss"] for r in report["modes"] if r.get("steps")}
    if "eager" in first:
        report["first_step_vs_eager"] = {
            mode: {
                k: abs(v - first["eager"][k]) / max(abs(first["eager"][k]), 1e-12)
                for k, v in parts.items()
                if k in first["eager"]
            }
            for mode, parts in first.items()
            if mode != "eager"
        }
        for mode, diff in report["first_step_vs_eager"].items():
            print(f"{mode} vs eager, step 1, relative: {diff}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
