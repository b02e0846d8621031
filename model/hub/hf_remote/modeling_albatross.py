"""An albatross encoder for Hugging Face `transformers` (remote code: ``trust_remote_code=True``).

Written by albatross's export (``python -m pretrain.export --format hf``); depends on `torch` and
`transformers` only. It computes what albatross's own model computes in inference, with the
same module names, so the exported ``model.safetensors`` holds albatross's tensors under their
own keys; weights that albatross parameterises (orthogonal maps) are stored as the matrices
themselves and are plain parameters here.

The backbone is ALBERT's: factorised embeddings (e -> d), a schedule of shared layer groups
(application l runs group l * G // L), post-LN / pre-LN / ReZero residuals, ALBERT's pooler. The
attention family's own code is in ``albatross_family.py`` (its ``PARTS``): the mixing step of a
standard layer (``kernel``), a module run once per forward (``state``), or a whole layer and
embeddings of its own (``layer``, ``embeddings``).

Classes: ``AlbatrossModel`` (AutoModel), ``AlbatrossForPreTraining`` (MLM + sentence order),
``AlbatrossForMaskedLM`` (AutoModelForMaskedLM, fill-mask), ``AlbatrossForSequenceClassification``
(cls / mean / max pooling, ``config.classifier_pooling``).

With labels, the losses include the family's auxiliary losses (e.g. TransJect's
eigen-reconstruction loss). The exported matrices are plain parameters: training them here
does not keep them orthogonal.
"""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    SequenceClassifierOutput,
)
from transformers.utils import ModelOutput

from .albatross_family import PARTS
from .configuration_albatross import AlbatrossConfig

ACTIVATIONS = {
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


class LayerContext:
    """What a layer application sees besides its hidden states."""

    def __init__(self, mask_BN, layer_index, first_use, residual_gate, extras):
        self.mask_BN = mask_BN  # bool (B, N), True at real tokens
        self.layer_index = layer_index  # application index, 0 .. L * inner - 1
        self.first_use = first_use  # first application of these weights in this forward
        self.residual_gate = residual_gate  # the application's residual scalar, or None
        self.extras = extras  # the family state's per-forward values


def add_aux(total, new):
    for name, value in new.items():
        total[name] = total[name] + value if name in total else value


class AlbertEmbeddings(nn.Module):
    """token + position + type (width e), LayerNorm, dropout, then e -> d."""

    def __init__(self, config):
        super().__init__()
        e = config.embedding_size
        self.word_embeddings = nn.Embedding(config.vocab_size, e)
        self.position_embeddings = (
            nn.Embedding(config.max_position_embeddings, e)
            if config.position_embedding == "absolute"
            else None
        )
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, e)
        self.norm = nn.LayerNorm(e, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.projection = nn.Linear(e, config.hidden_size)

    @property
    def token_embedding_weight(self):
        return self.word_embeddings.weight

    def forward(self, input_ids, token_type_ids=None):
        x = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            x = x + self.position_embeddings(positions)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = x + self.token_type_embeddings(token_type_ids)
        return self.projection(self.dropout(self.norm(x)))


class MultiHeadAttention(nn.Module):
    """Query/key/value/output projections around the family's mixing step."""

    def __init__(self, config, kernel):
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.query = nn.Linear(d, d)
        self.key = nn.Linear(d, d)
        self.value = nn.Linear(d, d)
        self.output = nn.Linear(d, d)
        self.kernel = kernel

    def _split(self, x):
        B, N, _ = x.shape
        return x.view(B, N, self.num_heads, -1).transpose(1, 2)  # (B, H, N, h)

    def forward(self, x, ctx):
        q, k, v = (self._split(lin(x)) for lin in (self.query, self.key, self.value))
        o, aux = self.kernel(q, k, v, ctx)
        B, H, N, h = o.shape
        return self.output(o.transpose(1, 2).reshape(B, N, H * h)), aux


class EncoderLayer(nn.Module):
    """Attention + feed-forward with post-LN (ALBERT), pre-LN or ReZero residuals."""

    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        self.residual = config.residual
        self.attention = MultiHeadAttention(config, PARTS["kernel"](config))
        self.ffn_in = nn.Linear(d, config.intermediate_size)
        self.ffn_out = nn.Linear(config.intermediate_size, d)
        self.act = ACTIVATIONS[config.hidden_act]
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        if config.residual != "rezero":
            self.attn_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
            self.ffn_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)

    @staticmethod
    def residual_gate_init(config):
        return 0.0 if config.residual == "rezero" else None

    def _ffn(self, x):
        return self.dropout(self.ffn_out(self.act(self.ffn_in(x))))

    def forward(self, x, ctx):
        if self.residual == "post_ln":
            attn, aux = self.attention(x, ctx)
            x = self.attn_norm(x + self.dropout(attn))
            x = self.ffn_norm(x + self._ffn(x))
        elif self.residual == "pre_ln":
            attn, aux = self.attention(self.attn_norm(x), ctx)
            x = x + self.dropout(attn)
            x = x + self._ffn(self.ffn_norm(x))
        else:  # rezero
            alpha = ctx.residual_gate
            attn, aux = self.attention(x, ctx)
            x = x + alpha * self.dropout(attn)
            x = x + alpha * self._ffn(x)
        return x, aux


class AlbatrossPreTrainedModel(PreTrainedModel):
    config_class = AlbatrossConfig
    base_model_prefix = "encoder"
    supports_gradient_checkpointing = False

    def _init_weights(self, module):
        """ALBERT's init for what a checkpoint does not hold (e.g. a new classifier): N(0, std)
        weights, zero biases, unit LayerNorm. A module's own parameters only."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif hasattr(module, "init_parameters"):
            module.init_parameters()


class AlbatrossModel(AlbatrossPreTrainedModel):
    """The encoder: input ids (B, N) -> hidden states (B, N, d) and ALBERT's pooled output."""

    def __init__(self, config):
        super().__init__(config)
        make_layer = PARTS.get("layer") or EncoderLayer
        self.embeddings = (PARTS.get("embeddings") or AlbertEmbeddings)(config)
        self.groups = nn.ModuleList(
            nn.ModuleList(make_layer(config) for _ in range(config.inner_group_num))
            for _ in range(config.num_hidden_groups)
        )
        L, G = config.num_hidden_layers, config.num_hidden_groups
        self.schedule = [layer * G // L for layer in range(L)]
        gate_init = make_layer.residual_gate_init(config)
        applications = config.num_hidden_layers * config.inner_group_num
        self.residual_gates = (
            nn.Parameter(torch.full((applications,), float(gate_init)))
            if gate_init is not None
            else None
        )
        self.family_state = PARTS["state"](config) if PARTS.get("state") else None
        self.final_norm = (
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            if config.residual == "pre_ln" and PARTS.get("layer") is None
            else None
        )
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size)
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    def encode(self, input_ids, attention_mask=None, token_type_ids=None, hidden=False):
        """(last hidden state, pooled output, hidden states or None, auxiliary losses)."""
        if input_ids is None or input_ids.dim() != 2:
            raise ValueError("input_ids of shape (batch, sequence) are required")
        if attention_mask is None:
            mask = torch.ones_like(input_ids, dtype=torch.bool)
        else:
            mask = attention_mask.to(torch.bool)
        x = self.embeddings(input_ids, token_type_ids)
        aux, extras = {}, {}
        if self.family_state is not None:
            extras, state_aux = self.family_state(x, mask)
            add_aux(aux, state_aux)
        states = [x] if hidden else None
        inner = self.config.inner_group_num
        index, used = 0, set()
        for group in self.schedule:
            for layer in self.groups[group]:
                gate = self.residual_gates[index] if self.residual_gates is not None else None
                ctx = LayerContext(mask, index, id(layer) not in used, gate, extras)
                used.add(id(layer))
                x, layer_aux = layer(x, ctx)
                add_aux(aux, layer_aux)
                index += 1
                if states is not None and index % inner == 0:
                    states.append(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
            if states is not None:
                states[-1] = x
        pooled = torch.tanh(self.pooler(x[:, 0]))
        return x, pooled, tuple(states) if states is not None else None, aux

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ):
        hidden = _flag(output_hidden_states, self.config.output_hidden_states)
        x, pooled, states, _ = self.encode(input_ids, attention_mask, token_type_ids, hidden)
        out = BaseModelOutputWithPooling(
            last_hidden_state=x, pooler_output=pooled, hidden_states=states
        )
        return out if _flag(return_dict, self.config.return_dict) else out.to_tuple()


def _flag(value, default):
    return default if value is None else value


def _aux_total(aux):
    return sum(aux.values()) if aux else None


class MLMHead(nn.Module):
    """dense(d -> e) -> act -> LayerNorm -> decoder tied to the token embedding (+ bias)."""

    def __init__(self, config, embedding_width):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, embedding_width)
        self.act = ACTIVATIONS[config.hidden_act]
        self.norm = nn.LayerNorm(embedding_width, eps=config.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden, token_embedding):
        return F.linear(self.norm(self.act(self.dense(hidden))), token_embedding, self.bias)


@dataclass
class AlbatrossForPreTrainingOutput(ModelOutput):
    loss: torch.FloatTensor = None
    logits: torch.FloatTensor = None
    sop_logits: torch.FloatTensor = None
    hidden_states: tuple = None


class AlbatrossForPreTraining(AlbatrossPreTrainedModel):
    """Encoder + MLM head (decoder tied to the token embedding) + sentence-order head."""

    _keys_to_ignore_on_load_unexpected = (r"^classifier\.",)

    def __init__(self, config):
        super().__init__(config)
        self.encoder = AlbatrossModel(config)
        width = self.encoder.embeddings.token_embedding_weight.shape[1]
        self.mlm = MLMHead(config, width)
        self.sop_dropout = nn.Dropout(config.hidden_dropout_prob)
        self.sop = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        labels=None,
        sentence_order_label=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ):
        hidden = _flag(output_hidden_states, self.config.output_hidden_states)
        x, pooled, states, aux = self.encoder.encode(
            input_ids, attention_mask, token_type_ids, hidden
        )
        logits = self.mlm(x, self.encoder.embeddings.token_embedding_weight)
        sop_logits = self.sop(self.sop_dropout(pooled))
        loss = None
        if labels is not None or sentence_order_label is not None:
            loss = _aux_total(aux) or 0.0
            if labels is not None:
                loss = loss + F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            if sentence_order_label is not None:
                loss = loss + F.cross_entropy(sop_logits, sentence_order_label.flatten())
        out = AlbatrossForPreTrainingOutput(
            loss=loss, logits=logits, sop_logits=sop_logits, hidden_states=states
        )
        return out if _flag(return_dict, self.config.return_dict) else out.to_tuple()


class AlbatrossForMaskedLM(AlbatrossPreTrainedModel):
    """Encoder + MLM head (decoder tied to the token embedding): fill-mask."""

    _keys_to_ignore_on_load_unexpected = (
        r"^sop\.",
        r"^classifier\.",
    )

    def __init__(self, config):
        super().__init__(config)
        self.encoder = AlbatrossModel(config)
        width = self.encoder.embeddings.token_embedding_weight.shape[1]
        self.mlm = MLMHead(config, width)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        labels=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ):
        hidden = _flag(output_hidden_states, self.config.output_hidden_states)
        x, _, states, aux = self.encoder.encode(input_ids, attention_mask, token_type_ids, hidden)
        logits = self.mlm(x, self.encoder.embeddings.token_embedding_weight)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss = loss + (_aux_total(aux) or 0.0)
        out = MaskedLMOutput(loss=loss, logits=logits, hidden_states=states)
        return out if _flag(return_dict, self.config.return_dict) else out.to_tuple()


def pool(hidden, mask, pooled_cls, how):
    """Masked pooling over real tokens: cls (ALBERT's pooler output), mean or max."""
    if how == "cls":
        return pooled_cls
    m = mask.unsqueeze(-1)
    if how == "mean":
        total = (hidden * m.to(hidden.dtype)).sum(1)
        return total / m.sum(1).clamp_min(1).to(hidden.dtype)
    if how == "max":
        return hidden.masked_fill(~m, torch.finfo(hidden.dtype).min).amax(1)
    raise ValueError(f"unknown classifier_pooling {how!r}; choose cls, mean or max")


class AlbatrossForSequenceClassification(AlbatrossPreTrainedModel):
    """Encoder -> masked pooling -> dropout -> linear; ``num_labels == 1`` is regression."""

    _keys_to_ignore_on_load_unexpected = (
        r"^mlm\.",
        r"^sop\.",
    )

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.encoder = AlbatrossModel(config)
        p = config.classifier_dropout
        self.dropout = nn.Dropout(config.hidden_dropout_prob if p is None else p)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        labels=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ):
        hidden = _flag(output_hidden_states, self.config.output_hidden_states)
        x, pooled, states, aux = self.encoder.encode(
            input_ids, attention_mask, token_type_ids, hidden
        )
        if attention_mask is None:
            mask = torch.ones_like(input_ids, dtype=torch.bool)
        else:
            mask = attention_mask.to(torch.bool)
        features = pool(x, mask, pooled, self.config.classifier_pooling)
        logits = self.classifier(self.dropout(features))
        loss = None
        if labels is not None:
            problem = self.config.problem_type
            if problem is None:
                if self.num_labels == 1:
                    problem = "regression"
                elif labels.dtype in (torch.long, torch.int):
                    problem = "single_label_classification"
                else:
                    problem = "multi_label_classification"
            if problem == "regression":
                loss = F.mse_loss(logits.squeeze(-1), labels.to(logits.dtype).view(-1))
            elif problem == "single_label_classification":
                loss = F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
            else:
                loss = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))
            loss = loss + (_aux_total(aux) or 0.0)
        out = SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=states)
        return out if _flag(return_dict, self.config.return_dict) else out.to_tuple()


__all__ = [
    "AlbatrossForMaskedLM",
    "AlbatrossForPreTraining",
    "AlbatrossForSequenceClassification",
    "AlbatrossModel",
    "AlbatrossPreTrainedModel",
]
