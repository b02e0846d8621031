"""Task heads and the models that combine them with an `Encoder`.

Legend: B batch, N tokens, d hidden width, e token-embedding width, V vocabulary, C classes.

* `EncoderForPretraining`: MLM head tied to the token embedding + sentence-order prediction.
* `EncoderForSequenceClassification`: classification or regression on a masked cls/mean/max pool.
* `EncoderForDualClassification`: a dual encoder for two-document matching (LRA Retrieval):
  both documents go through the same encoder, features [u, v, u*v, u-v] -> MLP -> classes.

Every model returns a `ModelOutput` whose `aux_losses` is the encoder's dict of weighted
auxiliary losses; the trainer adds `sum(aux_losses.values())` to the task loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from model.attention.base import AuxLosses
from model.config import EncoderConfig
from model.encoder import ACTIVATIONS, Encoder, EncoderOutput, add_aux, init_weights, key_mask
from model.norm import layer_norm
from model.orthogonal import Linear, orthogonal_cache

Pooling = Literal["cls", "mean", "max"]


def pool(hidden_BND: Tensor, mask_BN: Tensor, pooled_cls_BD: Tensor, how: Pooling) -> Tensor:
    """Masked pooling over real tokens: `cls` (ALBERT pooler output), `mean` or `max`."""
    if how == "cls":
        return pooled_cls_BD
    m_BN1 = mask_BN.unsqueeze(-1)
    if how == "mean":
        total = (hidden_BND * m_BN1.to(hidden_BND.dtype)).sum(1)
        return total / m_BN1.sum(1).clamp_min(1).to(hidden_BND.dtype)
    if how == "max":
        return hidden_BND.masked_fill(~m_BN1, torch.finfo(hidden_BND.dtype).min).amax(1)
    raise ValueError(f"unknown pooling {how!r}; choose cls, mean or max")


@dataclass
class ModelOutput:
    logits: Tensor | None = None
    """Task logits: (B, C) classification, (B,) regression, (B, N, V) MLM (pretraining)."""
    sop_logits: Tensor | None = None
    """(B, 2) sentence-order prediction logits (pretraining only)."""
    encoder: EncoderOutput | None = None
    """The encoder's output (hidden states, pooled output)."""
    aux_losses: AuxLosses = field(default_factory=dict)
    """Weighted auxiliary losses by name, to be added to the task loss."""


class MLMHead(nn.Module):
    """dense(d -> e) -> act -> LayerNorm -> decoder tied to the token embedding (+ bias)."""

    def __init__(self, cfg: EncoderConfig, embedding_width: int):
        super().__init__()
        self.dense = Linear(cfg.hidden_size, embedding_width)
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.norm = layer_norm(cfg, embedding_width)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def forward(self, hidden_BND: Tensor, token_embedding_VE: Tensor) -> Tensor:
        x = self.norm(self.act(self.dense(hidden_BND)))
        weight = token_embedding_VE
        if weight.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            weight = weight.to(x.dtype)
        return nn.functional.linear(x, weight, self.bias)


class _EncoderModel(nn.Module):
    """Shared plumbing: an encoder plus head(s); `head_config()` is what the release stores."""

    head_type: ClassVar[str]

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.config = cfg
        self.encoder = Encoder(cfg)

    def head_config(self) -> dict[str, Any]:
        return {"type": self.head_type}

    @property
    def compile_auto(self) -> bool:
        """Whether ``engine.compile: auto`` compiles this model's encoder on a GPU."""
        return self.encoder.compile_auto

    def _init_heads(self) -> None:
        for name, child in self.named_children():
            if name != "encoder":
                child.apply(lambda m: init_weights(m, self.config.initializer_range))


class EncoderForPretraining(_EncoderModel):
    """Encoder + MLM (tied decoder) + SOP. `logits` are the MLM logits.

    `masked_positions` (optional) decodes only some positions, saving the (B, N, V) tensor:
    a (B, K) integer index tensor gives logits (B, K, V), a fixed shape (what pretraining
    uses: `pretrain.objective.model_inputs` finds each row's masked positions on the device,
    or the loader's static-shape `masked_positions`): no host synchronisation, one graph for
    compiled models; a (B, N) bool mask gives logits (num_masked, V) in row-major order of the
    mask, a shape that depends on the data (indexing with the mask reads the count on the
    host: on a GPU, a synchronisation).
    """

    head_type = "pretraining"

    def __init__(self, cfg: EncoderConfig):
        super().__init__(cfg)
        width = self.encoder.embeddings.token_embedding_weight.shape[1]
        self.mlm = MLMHead(cfg, width)
        self.sop_dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.sop = Linear(cfg.hidden_size, 2)
        self._init_heads()

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        masked_positions: Tensor | None = None,
        output_hidden_states: bool = False,
    ) -> ModelOutput:
        with orthogonal_cache():  # the tied decoder may be orthogonal (TransJect): map it once
            return self._forward(
                input_ids, attention_mask, token_type_ids, masked_positions, output_hidden_states
            )

    def _forward(
        self, input_ids, attention_mask, token_type_ids, masked_positions, output_hidden_states
    ) -> ModelOutput:
        enc = self.encoder(input_ids, attention_mask, token_type_ids, output_hidden_states)
        hidden = enc.last_hidden_state
        if masked_positions is not None:
            if masked_positions.dtype == torch.bool:
                hidden = hidden[masked_positions]  # (num_masked, d)
            else:  # (B, K) indices -> (B, K, d)
                index = masked_positions.unsqueeze(-1).expand(-1, -1, hidden.size(-1))
                hidden = hidden.gather(1, index)
        logits = self.mlm(hidden, self.encoder.embeddings.token_embedding_weight)
        sop_logits = self.sop(self.sop_dropout(enc.pooled_output))
        return ModelOutput(
            logits=logits, sop_logits=sop_logits, encoder=enc, aux_losses=enc.aux_losses
        )


class EncoderForSequenceClassification(_EncoderModel):
    """Encoder -> masked pooling -> dropout -> linear. `num_labels == 1` means regression."""

    head_type = "sequence_classification"

    def __init__(
        self,
        cfg: EncoderConfig,
        num_labels: int = 2,
        pooling: Pooling = "cls",
        classifier_dropout: float | None = None,
    ):
        super().__init__(cfg)
        if num_labels < 1:
            raise ValueError(f"num_labels must be >= 1, got {num_labels}")
        if pooling not in ("cls", "mean", "max"):
            raise ValueError(f"unknown pooling {pooling!r}; choose cls, mean or max")
        if classifier_dropout is not None and not 0 <= classifier_dropout < 1:
            raise ValueError(f"classifier_dropout must be in [0, 1), got {classifier_dropout}")
        self.num_labels = num_labels
        self.pooling = pooling
        self.classifier_dropout = classifier_dropout
        # HF ALBERT's classifier_dropout_prob; None: the encoder's hidden_dropout_prob.
        self.dropout = nn.Dropout(
            cfg.hidden_dropout_prob if classifier_dropout is None else classifier_dropout
        )
        self.classifier = Linear(cfg.hidden_size, num_labels)
        self._init_heads()

    def head_config(self) -> dict[str, Any]:
        return {
            "type": self.head_type,
            "num_labels": self.num_labels,
            "pooling": self.pooling,
            "classifier_dropout": self.classifier_dropout,
        }

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        output_hidden_states: bool = False,
    ) -> ModelOutput:
        enc = self.encoder(input_ids, attention_mask, token_type_ids, output_hidden_states)
        mask = key_mask(input_ids, attention_mask)
        pooled = pool(enc.last_hidden_state, mask, enc.pooled_output, self.pooling)
        logits = self.classifier(self.dropout(pooled))
        if self.num_labels == 1:
            logits = logits.squeeze(-1)
        return ModelOutput(logits=logits, encoder=enc, aux_losses=enc.aux_losses)


class EncoderForDualClassification(_EncoderModel):
    """Two documents through one encoder; [u, v, u*v, u-v] -> dense -> act -> linear (LRA style)."""

    head_type = "dual_classification"

    def __init__(self, cfg: EncoderConfig, num_labels: int = 2, pooling: Pooling = "mean"):
        super().__init__(cfg)
        if pooling not in ("cls", "mean", "max"):
            raise ValueError(f"unknown pooling {pooling!r}; choose cls, mean or max")
        self.num_labels = num_labels
        self.pooling = pooling
        d = cfg.hidden_size
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.dense = Linear(4 * d, d)
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.classifier = Linear(d, num_labels)
        self._init_heads()

    def head_config(self) -> dict[str, Any]:
        return {"type": self.head_type, "num_labels": self.num_labels, "pooling": self.pooling}

    def _embed(self, ids: Tensor, mask: Tensor | None) -> tuple[Tensor, EncoderOutput]:
        enc = self.encoder(ids, mask)
        m = key_mask(ids, mask)
        return pool(enc.last_hidden_state, m, enc.pooled_output, self.pooling), enc

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        input_ids_2: Tensor,
        attention_mask_2: Tensor | None,
    ) -> ModelOutput:
        with orthogonal_cache():  # both passes share the orthogonal matrices
            u, enc1 = self._embed(input_ids, attention_mask)
            v, enc2 = self._embed(input_ids_2, attention_mask_2)
        features = torch.cat([u, v, u * v, u - v], dim=-1)
        logits = self.classifier(self.dropout(self.act(self.dense(self.dropout(features)))))
        # Both passes share the weights: average their auxiliary losses so each keeps the scale
        # of a single encoder pass (a weight penalty is not counted twice).
        aux: AuxLosses = {}
        add_aux(aux, enc1.aux_losses)
        add_aux(aux, enc2.aux_losses)
        aux = {name: value / 2 for name, value in aux.items()}
        return ModelOutput(logits=logits, encoder=enc1, aux_losses=aux)


HEADS: dict[str, type[_EncoderModel]] = {
    cls.head_type: cls
    for cls in (
        EncoderForPretraining,
        EncoderForSequenceClassification,
        EncoderForDualClassification,
    )
}


def build_model(cfg: EncoderConfig, head: dict[str, Any] | None = None) -> _EncoderModel:
    """Builds a model from an encoder config and a head config {"type": ..., **kwargs}."""
    head = dict(head or {"type": "pretraining"})
    head_type = head.pop("type", "pretraining")
    if head_type not in HEADS:
        raise ValueError(f"unknown head type {head_type!r}; valid: {sorted(HEADS)}")
    return HEADS[head_type](cfg, **head)
