"""ALBERT's pretraining objective: masked-LM loss on the masked positions only, plus
sentence-order prediction, plus the model's auxiliary losses (TransJect reconstruction, kernel
orthogonality penalty), all returned in one place so the trainer logs each of them.

The MLM head decodes only the masked positions, so the (B, N, V) logits tensor is never built,
and it does so with **fixed shapes**, without asking the host how many positions are masked
(which would stop the CPU until the GPU has caught up, at every micro-batch):
``model_inputs(batch, max_masked=K)`` gives the model a (B, K) index of each row's masked
positions (in order, then padding), computed on the device from ``mlm_labels != -100``; the head
gathers those K hidden states per row and the loss is the cross-entropy over the real ones
(padding slots carry the label -100). K is a static upper bound of the masked count per row: the
trainer takes the masking budget of a full-length row (``data_prep.masking.masking_budget``),
e.g. 77 of 512 tokens at 15%, so the head decodes about as many positions as there are masked
tokens. A row with more masked tokens than K would lose some: ``counts["mlm_dropped"]`` counts
them (the trainer fails at the next log if it is ever nonzero). Batches of the loader's static
mode (``data.masking.static_masked_positions``) bring their own ``masked_positions`` and
``masked_labels`` (B, K), used as they are.

The MLM loss is the mean over the masked tokens of the micro-batch, as in BERT and ALBERT (a
micro-batch without any contributes 0). Everything returned is a device tensor; nothing here
synchronises with the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE = -100


@dataclass
class PretrainingLoss:
    total: Tensor
    """Scalar to backpropagate: mlm + sop + sum(aux)."""
    parts: dict[str, Tensor]
    """Detached scalars: ``mlm``, ``sop``, ``aux/<name>``."""
    counts: dict[str, Tensor]
    """Detached sums for accuracies: ``mlm_correct``, ``mlm_total``, ``sop_correct``,
    ``sop_total``; ``mlm_dropped``: masked tokens beyond the head's K slots (0 unless the bound
    was wrong)."""


def masked_slots(labels: Tensor, k: int) -> Tensor:
    """(B, K) long: each row's positions with a label (``!= -100``) in increasing order, then
    positions without one (padding slots). Fixed shape, on the device, no host synchronisation:
    the K smallest of keys that put labelled positions first.

    >>> labels = torch.tensor([[-100, 7, -100, 9], [5, -100, -100, -100]])
    >>> masked_slots(labels, 3).tolist()
    [[1, 3, 0], [0, 1, 2]]
    """
    n = labels.shape[1]
    k = max(1, min(int(k), n))
    positions = torch.arange(n, device=labels.device)
    keys = torch.where(labels != IGNORE, positions, positions + n)  # labelled first, in order
    # The keys are distinct, so the k smallest are one set in one order: deterministic.
    return keys.topk(k, dim=1, largest=False, sorted=True).values % n


def model_inputs(batch: dict[str, Tensor], max_masked: int | None = None) -> dict[str, Tensor]:
    """Keyword arguments for ``EncoderForPretraining`` from a loader batch: the MLM head decodes
    ``masked_positions`` (B, K) of each row (the batch's own in the loader's static mode, else
    :func:`masked_slots` with K = ``max_masked``; None: K = the sequence length, exact for any
    batch but decoding every position)."""
    if "masked_positions" in batch:
        positions = batch["masked_positions"]
    else:
        labels = batch["mlm_labels"]
        positions = masked_slots(labels, labels.shape[1] if max_masked is None else max_masked)
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "token_type_ids": batch["token_type_ids"],
        "masked_positions": positions,
    }


def _mean_or_zero(losses_sum: Tensor, count: Tensor) -> Tensor:
    """``sum / count``, 0 when count is 0 (no branch on the host)."""
    return losses_sum / count.clamp_min(1).to(losses_sum.dtype)


def objective_terms(
    logits: Tensor, labels: Tensor, all_labels: Tensor, sop_logits: Tensor, sop_labels: Tensor
) -> dict[str, Tensor]:
    """The objective's tensor work, a function of tensors only, so that the engine can compile
    it with the encoder (``Engine.compile_beside``; the trainer does so whenever the encoder
    is compiled): the MLM and SOP cross-entropies and the counts for the accuracies.

    ``logits`` (R, V) are the decoded rows (the head's B x K slots, or the M masked positions),
    ``labels`` (R,) their labels (-100: a padding slot), ``all_labels`` (B, N) the batch's MLM
    labels (for ``mlm_dropped``), ``sop_logits`` (B, 2) and ``sop_labels`` (B,). Returns ``mlm``
    and ``sop`` (scalars with gradients) and the detached counts of :class:`PretrainingLoss`.

    Eagerly, the upcast of the (R, V) logits to fp32, the log-softmax, its backward and the
    arg-max each read or write the whole tensor (on a GPU at ALBERT-base's 64 x 77 slots and
    30000 tokens, 0.6 GB in fp32 per pass); compiled, Inductor reads the bf16 logits in a few
    fused reductions and writes their gradient once (docs in ``EngineConfig.compile``)."""
    logits = logits.float()
    valid = labels != IGNORE
    mlm_total = valid.sum()
    mlm = _mean_or_zero(
        F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum"), mlm_total
    )
    sop_logits = sop_logits.float()
    sop_valid = sop_labels != IGNORE
    sop_total = sop_valid.sum()
    sop = _mean_or_zero(
        F.cross_entropy(sop_logits, sop_labels, ignore_index=IGNORE, reduction="sum"), sop_total
    )
    with torch.no_grad():
        return {
            "mlm": mlm,
            "sop": sop,
            "mlm_correct": ((logits.argmax(-1) == labels) & valid).sum().float(),
            "mlm_total": mlm_total.float(),
            "mlm_dropped": ((all_labels != IGNORE).sum() - mlm_total).float(),
            "sop_correct": ((sop_logits.argmax(-1) == sop_labels) & sop_valid).sum().float(),
            "sop_total": sop_total.float(),
        }


def pretraining_loss(output, batch: dict[str, Tensor], terms=objective_terms) -> PretrainingLoss:
    """The loss of ``EncoderForPretraining(**model_inputs(batch, ...))`` on ``batch``.

    ``output.logits`` is (B, K, V) for the fixed-shape head (the labels are gathered at the
    same K slots per row, recomputed here exactly as ``model_inputs`` did, or the batch's
    ``masked_labels``), or (M, V) when the caller decoded a boolean mask (the labels are then
    the masked ones in row-major order; dynamic shapes). ``terms``: :func:`objective_terms`,
    or the engine's compiled version of it (``Engine.compile_beside``)."""
    all_labels = batch["mlm_labels"]
    logits = output.logits
    if logits.dim() == 3:
        if "masked_labels" in batch and "masked_positions" in batch:
            labels = batch["masked_labels"]
        else:
            labels = all_labels.gather(1, masked_slots(all_labels, logits.shape[1]))
        logits, labels = logits.flatten(0, 1), labels.flatten()  # (B*K, V), (B*K,)
    else:  # (M, V): a boolean mask decoded by the caller
        labels = all_labels[all_labels != IGNORE]
    t = terms(logits, labels, all_labels, output.sop_logits, batch["sop_labels"])
    mlm, sop = t["mlm"], t["sop"]
    total = mlm + sop
    parts = {"mlm": mlm.detach(), "sop": sop.detach()}
    for name, value in output.aux_losses.items():
        total = total + value.float()
        parts[f"aux/{name}"] = value.detach().float()
    counts = {k: v for k, v in t.items() if k not in ("mlm", "sop")}
    return PretrainingLoss(total=total, parts=parts, counts=counts)
