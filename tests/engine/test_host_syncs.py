"""No host synchronisation in a pretraining step between logging steps, counted on the CPU.

On a GPU, a call that needs a device value on the host (``.item()``, ``bool(t)``, ``.tolist()``,
``.cpu()``, ``nonzero``, indexing with a boolean mask, ...) stops the CPU until the GPU has
caught up, so the CPU can no longer queue work ahead. ``SyncRecorder`` (a
``TorchFunctionMode``) records every such call, and every ``torch.cuda.synchronize`` /
DeepSpeed accelerator ``synchronize``, while the real trainer (``pretrain.train.Trainer``,
in this process, one rank, the shipped recipes' engine settings) runs 8 steps logging every
4; the calls are attributed to the step whose iteration makes them. Steps 4 and 8 (logging, and
the final checkpoint) may synchronise; the others must not.

Two kinds of calls are host-only by construction and not counted: the data loader's (CPU
tensors of the host's pipeline, ``torch/utils/data``) and ``model.attention.base.
batch_is_padded``, which reads the attention mask only when it is on the CPU (on an
accelerator it assumes padding without reading it). ``numpy()`` is not counted either: it
fails on a device tensor, so it can only ever read host data (the trainer counts tokens that
way, from the CPU batch).

Before this change the same test failed: the loss check (``Engine.all_finite``: ``item`` and
``bool`` per micro-batch), the objective (``bool(...any())`` and boolean-mask indexing of the
labels), the MLM head (boolean-mask indexing of the hidden states), ``float(grad_norm)`` and
DeepSpeed's ZeRO 1-2 norm checks synchronised in every step.
"""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch
from pretrain_support import FAMILY, base_overrides, make_shards, one_process_rendezvous
from torch.overrides import TorchFunctionMode

import pretrain.train as train_module
from engine.recipe import load_recipe
from model.config import EncoderConfig
from model.heads import EncoderForPretraining
from pretrain.config import pretrain_config
from pretrain.objective import IGNORE, model_inputs, pretraining_loss

SYNCING = frozenset(
    {
        "item",
        "tolist",
        "cpu",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "_local_scalar_dense",
        "nonzero",
        "argwhere",
        "masked_select",
        "unique",
        "unique_consecutive",
    }
)
HOST_ONLY_FRAMES = ("batch_is_padded",)
HOST_ONLY_FILES = ("torch/utils/data/",)
STEPS, LOG_EVERY = 8, 4


def _has_bool_index(index) -> bool:
    if isinstance(index, torch.Tensor):
        return index.dtype == torch.bool
    if isinstance(index, (tuple, list)):
        return any(_has_bool_index(i) for i in index)
    return False


class SyncRecorder(TorchFunctionMode):
    """Records (step, call, where) for every call that reads a tensor on the host or indexes
    with a boolean mask (data-dependent shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.calls: list[tuple[int, str, str]] = []

    def record(self, name: str) -> None:
        frames = traceback.extract_stack()[:-2]
        if any(f.name in HOST_ONLY_FRAMES for f in frames) or any(
            part in f.filename.replace("\\", "/") for f in frames for part in HOST_ONLY_FILES
        ):
            return
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-4:][::-1])
        self.calls.append((self.step, name, where))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCING or (
            name in ("__getitem__", "__setitem__", "index_put_", "index_put")
            and len(args) > 1
            and _has_bool_index(args[1])
        ):
            self.record(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("syncs"))


def run_recorded(shards: Path, run_dir: Path, extra: list[str]) -> SyncRecorder:
    overrides = [
        *base_overrides(shards, run_dir, STEPS),
        f"train.log_every={LOG_EVERY}",
        "optimizer.name=lamb",  # auto: the foreach LAMB
        "data.verify_checksums=false",
        "train.export_at_end=false",
        *extra,
    ]
    trainer = train_module.Trainer(pretrain_config(load_recipe(None, overrides)))
    recorder = SyncRecorder()
    step_fn = trainer._train_step

    def tagged_step(*args, **kwargs):
        recorder.step = trainer.step + 1  # the iteration of this step, logging included
        return step_fn(*args, **kwargs)

    trainer._train_step = tagged_step
    patches = [(torch.cuda, "synchronize")]
    try:
        from deepspeed.accelerator import get_accelerator

        patches.append((get_accelerator(), "synchronize"))
    except ImportError:
        pass
    saved = [(owner, name, getattr(owner, name)) for owner, name in patches]
    for owner, name, original in saved:

        def counting(*args, _name=name, _original=original, **kwargs):
            recorder.record(f"{_name}()")
            return _original(*args, **kwargs)

        setattr(owner, name, counting)
    try:
        with recorder:
            result = trainer.run()
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
    assert result.state == "completed" and result.step == STEPS
    return recorder


@pytest.mark.parametrize(
    "extra",
    [
        ["engine.backend=deepspeed", "engine.zero_stage=0", "engine.precision=bf16-mixed"],
        ["engine.backend=deepspeed", "engine.zero_stage=2", "engine.precision=bf16-mixed"],
        ["engine.backend=torch", "engine.precision=fp32", "engine.gradient_accumulation_steps=2"],
        # TransJect: its orthogonal maps (block inverse, small-block `inv_ex`), once per step
        # under accumulation, its eigen-state and gate
        [
            *FAMILY["transject"],
            "engine.backend=deepspeed",
            "engine.zero_stage=0",
            "engine.precision=bf16-mixed",
            "engine.gradient_accumulation_steps=2",
        ],
    ],
    ids=[
        "deepspeed-zero0-bf16mixed",
        "deepspeed-zero2-bf16mixed",
        "torch-accumulation2",
        "transject-zero0-bf16mixed-accumulation2",
    ],
)
def test_no_host_sync_between_logging_steps(shards, tmp_path, extra, monkeypatch):
    # One process, as torchrun would describe it: the process group of an earlier in-process
    # engine stays (DeepSpeed caches it), and DeepSpeed still reads LOCAL_RANK.
    one_process_rendezvous(monkeypatch)
    recorder = run_recorded(shards, tmp_path / "run", extra)
    logging_steps = {s for s in range(1, STEPS + 1) if s % LOG_EVERY == 0}
    between = [c for c in recorder.calls if c[0] >= 1 and c[0] not in logging_steps]
    assert not between, "host synchronisations between logging steps:\n" + "\n".join(
        f"step {s}: {name} at {where}" for s, name, where in between[:20]
    )
    # The logging steps do read: one batched read of the window's sums (plus the checkpoint at
    # the end), so the recorder does see what it looks for.
    per_step = Counter(s for s, _, _ in recorder.calls)
    assert per_step[LOG_EVERY] >= 1


# ----------------------------------------------------------------------------- the objective


def _old_pretraining_loss(model, batch):
    """The masked-only objective before fixed shapes: boolean-mask indexing in the head and of
    the labels, the mean cross-entropy over the masked tokens."""
    mask = batch["mlm_labels"] != IGNORE
    out = model(
        batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], masked_positions=mask
    )
    labels = batch["mlm_labels"][mask]
    mlm = torch.nn.functional.cross_entropy(out.logits.float(), labels)
    sop = torch.nn.functional.cross_entropy(out.sop_logits.float(), batch["sop_labels"])
    correct = (out.logits.argmax(-1) == labels).sum().float()
    return mlm, sop, correct, mlm + sop + sum(out.aux_losses.values())


@pytest.mark.parametrize("family", ["softmax", "transject"])
def test_fixed_shape_mlm_equals_the_masked_only_objective(family):
    """Same losses, accuracies and gradients as boolean-mask decoding (fp32, to rounding), with
    rows of 0 .. many masked tokens; a micro-batch without any contributes 0."""
    cfg = EncoderConfig.preset("debug")
    cfg = EncoderConfig(**{**cfg.to_dict(), "attention": family, "hidden_dropout_prob": 0.0})
    torch.manual_seed(0)
    model = EncoderForPretraining(cfg).eval()
    b, n = 4, 24
    ids = torch.randint(5, cfg.vocab_size, (b, n))
    chosen = torch.rand(b, n) < torch.tensor([0.15, 0.4, 0.0, 0.1])[:, None]
    chosen[0, 1] = True
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones(b, n, dtype=torch.long),
        "token_type_ids": torch.zeros(b, n, dtype=torch.long),
        "mlm_labels": torch.where(chosen, ids, torch.full_like(ids, IGNORE)),
        "sop_labels": torch.tensor([0, 1, 1, 0]),
    }
    k = int(chosen.sum(1).max())
    new = pretraining_loss(model(**model_inputs(batch, max_masked=k)), batch)
    new.total.backward()
    grads_new = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    mlm, sop, correct, total = _old_pretraining_loss(model, batch)
    total.backward()
    grads_old = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    torch.testing.assert_close(new.parts["mlm"], mlm.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(new.parts["sop"], sop.detach(), rtol=1e-6, atol=1e-6)
    assert new.counts["mlm_total"] == chosen.sum() and new.counts["mlm_correct"] == correct
    assert new.counts["mlm_dropped"] == 0
    for a, c in zip(grads_new, grads_old, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-7)
    # A bound below a row's count drops tokens, and says so; none masked at all: 0, finite.
    short = pretraining_loss(model(**model_inputs(batch, max_masked=2)), batch)
    assert short.counts["mlm_dropped"] == (chosen.sum(1) - 2).clamp(min=0).sum()
    empty = {**batch, "mlm_labels": torch.full_like(ids, IGNORE)}
    none = pretraining_loss(model(**model_inputs(empty, max_masked=k)), empty)
    assert none.parts["mlm"] == 0 and none.counts["mlm_total"] == 0


@pytest.mark.parametrize(
    "backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.integration)]
)
def test_compiled_objective_terms_equal_eager(backend):
    """The loss terms as the trainer runs them when the encoder is compiled
    (``Engine.compile_beside``: ``compile_function(objective_terms)``) equal the eager ones:
    losses, counts and the gradients of the bf16 logits, with padding slots, a row without
    masked tokens, a dropped token and an ignored SOP label; and a micro-batch without any
    masked token still gives 0."""
    from engine.engine import compile_function
    from pretrain.objective import objective_terms

    torch._dynamo.reset()
    torch.manual_seed(0)
    b, n, k, v = 4, 16, 5, 97
    labels = torch.full((b, n), IGNORE)
    for row, count in enumerate([3, 0, 6, 5]):  # row 2: one more than the K = 5 slots
        positions = torch.randperm(n)[:count]
        labels[row, positions] = torch.randint(0, v, (count,))
    batch = {"mlm_labels": labels, "sop_labels": torch.tensor([0, 1, IGNORE, 1])}

    def loss(terms, batch):
        logits = torch.randn(b, k, v, generator=torch.Generator().manual_seed(1))
        logits = logits.to(torch.bfloat16).requires_grad_()
        sop = torch.randn(b, 2, generator=torch.Generator().manual_seed(2)).requires_grad_()
        aux = {"extra": torch.tensor(0.25)}
        output = type("Out", (), {"logits": logits, "sop_logits": sop, "aux_losses": aux})
        result = pretraining_loss(output, batch, terms)
        result.total.backward()
        return result, logits.grad, sop.grad

    compiled = compile_function(objective_terms, backend=backend)
    for case in (batch, {**batch, "mlm_labels": torch.full((b, n), IGNORE)}):
        eager, eager_grad, eager_sop_grad = loss(objective_terms, case)
        fused, fused_grad, fused_sop_grad = loss(compiled, case)
        for key in ("mlm", "sop", "aux/extra"):
            torch.testing.assert_close(fused.parts[key], eager.parts[key], rtol=1e-6, atol=1e-6)
        assert {key: float(c) for key, c in fused.counts.items()} == {
            key: float(c) for key, c in eager.counts.items()
        }
        torch.testing.assert_close(fused_grad, eager_grad, rtol=1e-2, atol=1e-6)  # bf16
        torch.testing.assert_close(fused_sop_grad, eager_sop_grad)
    assert eager.parts["mlm"] == 0 and eager.counts["mlm_total"] == 0
    first, _, _ = loss(objective_terms, batch)
    assert first.counts["mlm_total"] == 3 + 5 + 5 and first.counts["mlm_dropped"] == 1
    torch._dynamo.reset()
