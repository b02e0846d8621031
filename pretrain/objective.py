"""ALBERT's pretraining objective: masked-LM loss on the masked positions only, plus
sentence-order prediction, plus the model's auxiliary losses (TransJect reconstruction, kernel
orthogonality penalty), all returned in one place so the trainer logs each of them.

The MLM head decodes only the masked positions (``masked_positions`` = ``mlm_labels != -100``),
so the (B, N, V) logits tensor is never built. The MLM loss is the mean over the masked tokens
of the micro-batch, as in BERT and ALBERT.
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
    ``sop_total``."""


def model_inputs(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """Keyword arguments for ``EncoderForPretraining`` from a loader batch (sparse MLM head)."""
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "token_type_ids": batch["token_type_ids"],
        "masked_positions": batch["mlm_labels"] != IGNORE,
    }


def pretraining_loss(output, batch: dict[str, Tensor]) -> PretrainingLoss:
    """The loss of ``EncoderForPretraining(**model_inputs(batch))`` on ``batch``."""
    labels = batch["mlm_labels"][batch["mlm_labels"] != IGNORE]  # (M,) in the head's order
    mlm_logits = output.logits.float()  # (M, V)
    if labels.numel():
        mlm = F.cross_entropy(mlm_logits, labels)
    else:  # no masked token in this micro-batch (tiny batches): contributes nothing
        mlm = mlm_logits.sum() * 0.0
    sop_logits = output.sop_logits.float()
    sop_labels = batch["sop_labels"]
    if bool((sop_labels != IGNORE).any()):
        sop = F.cross_entropy(sop_logits, sop_labels, ignore_index=IGNORE)
    else:
        sop = sop_logits.sum() * 0.0
    total = mlm + sop
    parts = {"mlm": mlm.detach(), "sop": sop.detach()}
    for name, value in output.aux_losses.items():
        total = total + value.float()
        parts[f"aux/{name}"] = value.detach().float()
    with torch.no_grad():
        sop_valid = sop_labels != IGNORE
        counts = {
            "mlm_correct": (mlm_logits.argmax(-1) == labels).sum().float(),
            "mlm_total": torch.tensor(float(labels.numel()), device=labels.device),
            "sop_correct": ((sop_logits.argmax(-1) == sop_labels) & sop_valid).sum().float(),
            "sop_total": sop_valid.sum().float(),
        }
    return PretrainingLoss(total=total, parts=parts, counts=counts)
