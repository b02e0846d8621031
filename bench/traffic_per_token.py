"""Memory traffic of a training step per family, counted on the CPU: what a GPU's eager step
spends outside its matrix products and attention kernels.

A diagnostic beside the GPU suite, not a benchmark: it times nothing. The recipe's model
(``configs/pretrain/<base>[-<family>].yaml``: the same ``EncoderForPretraining`` and loss as
the trainer, bf16 autocast as ``bf16-mixed`` runs it) takes one forward and backward under a
``TorchDispatchMode`` that sees every operator as it reaches the kernels (after autograd and
autocast). For each operator that is not a view, it adds the bytes of its tensor inputs and
outputs (what the operator reads and writes, once); matrix products and attention kernels are
counted apart (their time is the FLOPs', not the bytes'). This is run at two batch sizes and
split into a fixed part (weight-sized work: casts of the weights, gradient sums of the shared
layer, TransJect's orthogonal maps) and a part per token, then projected to the recipe's GPU
batch (``--target-batch`` x ``--seq``), with the time those bytes take at ``--bandwidth``
(default: an H100's 3.35 TB/s; eager kernels reach perhaps 70-90% of it).

The operator count is that of an eager step (one kernel launch each, roughly, on a GPU).
Operators are the CPU's: where the CPU takes another path (SDPA's math kernel for an additive
bias, dropout in three operators instead of one fused kernel), the count differs from the GPU's,
so compare families and commits with it, not the GPU's absolute time. Autocast differs too:
torch's CPU and CUDA autocast put different operators in fp32. The model fixes the dtype of
what matters most itself (the LayerNorms' output, `model.norm_output`, the same on both
devices; `--override model.norm_output=fp32` counts what GPU runs before that option did,
torch's CUDA rule); elsewhere a reduction CUDA's autocast runs in fp32 (``sum``, ``softmax``)
may upcast its input on a GPU where the CPU does not, which compiled steps fuse away.

``--compiled`` counts the step as the recipes run it on a GPU, compiled by Inductor: the
forward and loss compiled as one function, each kernel Inductor generates (forward and
backward graphs) counted with the bytes its scheduler estimates it reads and writes; the
operator count is then the kernel count (`count_compiled_step`). Inductor's CPU backend fuses
like its GPU backend in the main, but not in every detail (a CPU falls back to ATen for some
scatters, and decomposes SDPA with an additive bias into its math: TISA's count there is not a
GPU's).

    python -m bench.traffic_per_token --families softmax tisa kernel transject
    python -m bench.traffic_per_token --compiled --families softmax kernel transject
    python -m bench.traffic_per_token --families kernel --top 20 --out traffic.json
    python -m bench.traffic_per_token --forward-only --families softmax kernel --seq 4096 \
        --target-batch 8 --override model.max_position_embeddings=4096 model.num_hidden_layers=1
"""

from __future__ import annotations

import argparse
import collections
import contextlib
from pathlib import Path

from bench.common import write_result

VIEWS = frozenset(
    [
        "view",
        "_unsafe_view",
        "t",
        "transpose",
        "expand",
        "permute",
        "unsqueeze",
        "squeeze",
        "slice",
        "select",
        "split",
        "split_with_sizes",
        "as_strided",
        "detach",
        "alias",
        "_reshape_alias",
        "reshape",
        "unbind",
        "lift_fresh",
        "chunk",
        "narrow",
        "diagonal",
        "unflatten",
        "flatten",
        "_conj",
        "conj",
        "view_as",
        "expand_as",
        "broadcast_to",
        "movedim",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
    ]
)
"""Operators that move no data (views, and allocations without a fill)."""

COMPUTE = ("mm", "bmm", "addmm", "baddbmm", "linear", "matmul", "_scaled_mm")
"""Matrix products; operators whose name holds "attention" count as attention kernels."""


def kind_of(name: str) -> str | None:
    """ "compute", "memory", or None for an operator that moves no data. An in-place product
    (`baddbmm_`) is a product."""
    if name in VIEWS:
        return None
    return "compute" if name.rstrip("_") in COMPUTE or "attention" in name else "memory"


def step_output(model, batch, max_masked: int, forward_only: bool):
    """What one counted step computes: the recipe's model on `batch` and its pretraining loss,
    or only the MLM logits for `forward_only`."""
    from pretrain.objective import model_inputs, pretraining_loss

    output = model(**model_inputs(batch, max_masked))
    return output.logits if forward_only else pretraining_loss(output, batch).total


def eager_traffic():
    """A `TorchDispatchMode` that counts, while active, every operator that is not a view: its
    kind (`kind_of`) and the bytes of its tensor inputs and outputs, in `ops`, `bytes` and
    `by_op` (memory-bound operators by name)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Traffic(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: collections.Counter = collections.Counter()
            self.bytes: collections.Counter = collections.Counter()
            self.by_op: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            kind = kind_of(name)
            if kind is not None:
                # a factory (new_ones, zeros_like, ...) takes a tensor for its shape, not its data
                read = () if name.startswith("new_") or name.endswith("_like") else (args, kwargs)
                tensors = [t for t in tree_flatten((read, out))[0] if isinstance(t, torch.Tensor)]
                moved = sum(t.numel() * t.element_size() for t in tensors)
                self.ops[kind] += 1
                self.bytes[kind] += moved
                if kind == "memory":
                    self.by_op[name] += moved
            return out

    return Traffic()


def counts_of(traffic) -> dict:
    """{"ops": {kind: count}, "bytes": {kind: bytes}, "by_op": {name: memory bytes}} of an
    `eager_traffic` or an `InductorTraffic`."""
    return {"ops": dict(traffic.ops), "bytes": dict(traffic.bytes), "by_op": dict(traffic.by_op)}


def count_step(model, batch, max_masked: int, forward_only: bool = False) -> dict:
    """{"ops": {kind: count}, "bytes": {kind: bytes}, "by_op": {name: memory bytes}} of one
    forward + backward of `model` on `batch` under bf16 autocast (`forward_only`: one forward
    without gradients, the model in eval mode)."""
    import torch

    def step() -> None:
        if forward_only:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                step_output(model, batch, max_masked, forward_only)
            return
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = step_output(model, batch, max_masked, forward_only)
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # first-step work (lazy state, caches) stays out of the count
    with eager_traffic() as traffic:
        step()
    return counts_of(traffic)


# Origins of a fused kernel that say nothing about what it computes (layout, dtype, views).
_PLUMBING = frozenset(
    ["reshape", "permute", "convert_element_type", "view", "unsqueeze", "squeeze", "expand",
     "clone", "full", "iota", "select", "slice", "alias"]
)  # fmt: skip


def _extern_name(node) -> str:
    """The operator behind one of Inductor's extern kernels ("mm", "scatter_add", ...)."""
    op = getattr(node, "op_overload", None)
    if op is not None:
        return op.overloadpacket.__name__ if hasattr(op, "overloadpacket") else str(op)
    name = getattr(node, "python_kernel_name", None) or type(node).__name__
    return name.rsplit(".", 2)[-2] if name.endswith(".default") else name.rsplit(".", 1)[-1]


def _fused_label(scheduler_node) -> str:
    """A fused kernel named by the operators it was made from, without the plumbing."""
    origins = set()
    for sub in scheduler_node.get_nodes():
        for origin in getattr(sub.node, "origins", None) or ():
            origins.add(str(origin.target).split(".")[-2 if "." in str(origin.target) else -1])
    named = sorted(origins - _PLUMBING) or sorted(origins) or ["copy"]
    return "+".join(named)


class InductorTraffic:
    """Counts, while active (a context manager), every kernel Inductor generates: its kind
    (`kind_of` for an extern kernel, "memory" for a fused one) and the bytes its scheduler
    estimates it reads and writes (`get_read_write_buffers_sizes`: each buffer once, at most its
    size), in `ops`, `bytes` and `by_op` (memory-bound kernels named by the operators they
    fused, prefixed with `phase`). Compilations it should see must happen while it is active,
    with Inductor's FX graph cache off (a cached graph skips the code generation).

    Uses Inductor internals (`GraphLowering.codegen`, the scheduler's nodes); a torch that
    renames them fails here with a clear error, never with a silent zero."""

    def __init__(self, phase: str = "forward"):
        from torch._inductor import scheduler as inductor_scheduler

        for needed in ("ExternKernelSchedulerNode", "NopKernelSchedulerNode"):
            if not hasattr(inductor_scheduler, needed):
                raise RuntimeError(f"this torch's Inductor has no scheduler.{needed}: counting "
                                   "reads Inductor internals as torch 2.13 has them")  # fmt: skip
        self.phase = phase
        self.ops: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()
        self.by_op: collections.Counter = collections.Counter()

    def _count(self, graph) -> None:
        from torch._inductor import scheduler as inductor_scheduler

        for node in graph.scheduler.nodes:
            if isinstance(node, inductor_scheduler.NopKernelSchedulerNode):
                continue
            nbytes = int(node.get_read_write_buffers_sizes())
            if isinstance(node, inductor_scheduler.ExternKernelSchedulerNode):
                name = _extern_name(node.node)
                kind = kind_of(name) or "memory"
            else:
                name, kind = _fused_label(node), "memory"
            self.ops[kind] += 1
            self.bytes[kind] += nbytes
            if kind == "memory":
                self.by_op[f"{self.phase}: {name}"] += nbytes

    def __enter__(self) -> InductorTraffic:
        from torch._inductor import config as inductor_config
        from torch._inductor.graph import GraphLowering

        self._codegen = codegen = GraphLowering.codegen

        def counting_codegen(graph, *a, **k):
            out = codegen(graph, *a, **k)
            self._count(graph)
            return out

        GraphLowering.codegen = counting_codegen
        self._no_cache = inductor_config.patch(fx_graph_cache=False)
        self._no_cache.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        from torch._inductor.graph import GraphLowering

        GraphLowering.codegen = self._codegen
        self._no_cache.__exit__(*exc)


def count_compiled_step(model, batch, max_masked: int, forward_only: bool = False) -> dict:
    """`count_step` for the step compiled by Inductor (what the recipes run on a GPU): the
    model's forward and loss compiled as one function (the engine compiles the encoder and
    the loss terms and leaves the heads eager; here the heads are compiled too, the same for
    every family), its
    forward and backward graphs each counted from Inductor's scheduler as it generates them.
    Each fused kernel counts the bytes Inductor's scheduler estimates it reads and writes
    (`get_read_write_buffers_sizes`: each buffer once, at most its size); an extern kernel (a
    matrix product, an attention kernel, or an operator Inductor leaves to ATen) is sorted by
    `kind_of` like an eager operator (`InductorTraffic`). TransJect's orthogonal maps are
    evaluated before the compiled function, as the engine does, and not counted (a fixed,
    weight-sized cost)."""
    import torch
    import torch._dynamo

    from model.orthogonal import evaluate_orthogonal_maps, orthogonal_cache

    torch._dynamo.reset()  # a fresh, static-shape compilation for this batch size
    compiled = torch.compile(step_output, backend="inductor", dynamic=False)
    with InductorTraffic("forward") as traffic:
        grad = contextlib.nullcontext() if not forward_only else torch.no_grad()
        with grad, orthogonal_cache() as store, torch.autocast("cpu", dtype=torch.bfloat16):
            evaluate_orthogonal_maps(model, store)
            loss = compiled(model, batch, max_masked, forward_only)
        if not forward_only:
            traffic.phase = "backward"
            loss.backward()
    model.zero_grad(set_to_none=True)
    if not traffic.bytes:
        raise RuntimeError("Inductor generated no kernel for the step: nothing was counted")
    return counts_of(traffic)


def measure(family: str, args) -> dict:
    """The two counts, the fit, and the projection to the target batch."""
    import torch

    from bench.bench_pretrain_throughput import load_config, synthetic_batches
    from data_prep.masking import masking_budget
    from model.heads import EncoderForPretraining

    cfg = load_config(args.base, family, args.seq, args.batches[0], args, {})
    model_cfg = cfg.encoder_config(args.vocab, 0)
    torch.manual_seed(0)
    model = EncoderForPretraining(model_cfg).train(not args.forward_only)
    # The MLM head's slots per row as the trainer sets them (the masking budget of a full row),
    # the same at every batch size, so the count grows linearly with the batch.
    max_masked = masking_budget(args.seq, cfg.data.masking)
    counts = {}
    count = count_compiled_step if args.compiled else count_step
    for b in args.batches:
        batch = synthetic_batches(1, b, args.seq, args.vocab, padded=args.padding != "none")[0]
        counts[b] = count(model, batch, max_masked, args.forward_only)
    (b0, c0), (b1, c1) = sorted(counts.items())
    tokens0, tokens1 = b0 * args.seq, b1 * args.seq
    target_tokens = args.target_batch * args.seq

    def fit(get) -> tuple[float, float]:
        per_token = (get(c1) - get(c0)) / (tokens1 - tokens0)
        return get(c0) - per_token * tokens0, per_token

    fixed, per_token = fit(lambda c: c["bytes"].get("memory", 0))
    names = set(c0["by_op"]) | set(c1["by_op"])
    by_op = {n: fit(lambda c, n=n: c["by_op"].get(n, 0)) for n in names}
    target = fixed + per_token * target_tokens
    return {
        "family": family,
        "ops_per_step": sum(c1["ops"].values()),
        "memory_ops_per_step": c1["ops"].get("memory", 0),
        "fixed_mb": fixed / 1e6,
        "per_token_kb": per_token / 1e3,
        "target_gb": target / 1e9,
        "target_ms": target / args.bandwidth * 1e3,
        "top_per_token_kb": {
            n: round(v[1] / 1e3, 1)
            for n, v in sorted(by_op.items(), key=lambda kv: -kv[1][1])[: args.top]
        },
        "top_fixed_mb": {
            n: round(v[0] / 1e6, 1)
            for n, v in sorted(by_op.items(), key=lambda kv: -kv[1][0])[: args.top // 2]
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="+", default=["softmax", "tisa", "kernel", "transject"])
    p.add_argument(
        "--base", default="albert-base", help="recipe: configs/pretrain/<base>[-<family>]"
    )
    p.add_argument("--seq", type=int, default=512)
    p.add_argument(
        "--batches", type=int, nargs=2, default=[1, 2], help="the two counted batch sizes"
    )
    p.add_argument("--target-batch", type=int, default=64, help="the GPU micro-batch projected to")
    p.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s (H100: 3.35e12)")
    p.add_argument("--vocab", type=int, default=30000)
    p.add_argument("--padding", default="none", choices=["one-short-row", "none"])
    p.add_argument("--top", type=int, default=10, help="operators listed per family")
    p.add_argument("--override", nargs="*", default=[], help="recipe overrides, key=value")
    p.add_argument(
        "--forward-only", action="store_true", help="one forward without gradients, eval mode"
    )
    p.add_argument(
        "--compiled",
        action="store_true",
        help="count the step compiled by Inductor (fused kernels) instead of the eager one",
    )
    p.add_argument("--out", type=Path, default=None)
    # what load_config reads besides the recipe (a CPU fp32 engine: never built here)
    p.set_defaults(zero_stage=0, precision="fp32", accumulation=1, device="cpu")
    args = p.parse_args()
    if args.batches[0] == args.batches[1]:
        p.error("--batches needs two different sizes")
    rows = [measure(f, args) for f in args.families]
    base = next((r for r in rows if r["family"] == "softmax"), rows[0])
    what = "forward (eval, no gradients)" if args.forward_only else "training step"
    if args.compiled:
        what += ", compiled (Inductor's kernels)"
    print(
        f"{args.base}, {what}, seq {args.seq}, bf16 autocast, counted at batch {args.batches[0]} and "
        f"{args.batches[1]}, projected to {args.target_batch} x {args.seq} "
        f"at {args.bandwidth / 1e12:.2f} TB/s\n"
    )
    print(
        "| family | operators / step | memory-bound operators | fixed MB | KB / token "
        f"| GB at {args.target_batch} x {args.seq} | ms at the bandwidth | vs {base['family']} |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['ops_per_step']} | {r['memory_ops_per_step']} "
              f"| {r['fixed_mb']:.0f} | {r['per_token_kb']:.0f} | {r['target_gb']:.1f} "
              f"| {r['target_ms']:.1f} | {r['target_gb'] / base['target_gb']:.2f}x |")  # fmt: skip
    for r in rows:
        print(f"\n{r['family']}, KB per token:", r["top_per_token_kb"])
        print(f"{r['family']}, fixed MB:", r["top_fixed_mb"])
    write_result(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
