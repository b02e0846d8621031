"""The encoder: embeddings, a schedule of shared layer groups, and ALBERT's pooler.

Legend: B batch, N tokens, d hidden width, L num_hidden_layers, G num_hidden_groups.

ALBERT's cross-layer sharing is an execution order over a few distinct layers, not copied
modules: `groups[g][i]` are the distinct layers and application l (0 <= l < L) runs every layer
of group `l * G // L` in turn. Per-application state (the ReZero / TransJect residual scalars,
TISA `per_layer` scorers) is indexed by the application, not by the weights.

Activation checkpointing is applied from outside: `Encoder.checkpoint_fn` is called as
`checkpoint_fn(run_layer, x_BND, ctx)` for every layer application when set (e.g.
`functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)`); see
`enable_activation_checkpointing`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from model.attention import ATTENTION_REGISTRY, LayerContext, MultiHeadAttention
from model.attention.base import (
    AuxLosses,
    batch_is_padded,
    cache_fused_qkv,
    key_mask,
    make_linear,
)
from model.config import EncoderConfig
from model.embeddings import AlbertEmbeddings
from model.norm import layer_norm
from model.orthogonal import (
    active_orthogonal_cache,
    evaluate_orthogonal_maps,
    is_orthogonal_parametrized,
    orthogonal_cache,
)

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


def add_aux(total: AuxLosses, new: AuxLosses) -> None:
    """Accumulates auxiliary losses by name, in place."""
    for name, value in new.items():
        total[name] = total[name] + value if name in total else value


class EncoderLayer(nn.Module):
    """Attention + feed-forward block with post-LN (ALBERT), pre-LN or ReZero residuals."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        family = ATTENTION_REGISTRY.get(cfg.attention)
        d = cfg.hidden_size
        self.residual = cfg.residual
        self.attention = MultiHeadAttention(cfg, family.kernel(cfg))
        self.ffn_in = make_linear(cfg, d, cfg.intermediate_size)
        self.ffn_out = make_linear(cfg, cfg.intermediate_size, d)
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        if cfg.residual != "rezero":
            self.attn_norm = layer_norm(cfg, d)
            self.ffn_norm = layer_norm(cfg, d)

    @staticmethod
    def residual_gate_init(cfg: EncoderConfig) -> float | None:
        """Initial per-application residual scalar, or None when the layer needs none."""
        return 0.0 if cfg.residual == "rezero" else None

    def _ffn(self, x_BND: Tensor) -> Tensor:
        return self.dropout(self.ffn_out(self.act(self.ffn_in(x_BND))))

    def forward(self, x_BND: Tensor, ctx: LayerContext) -> tuple[Tensor, AuxLosses]:
        if self.residual == "post_ln":
            attn = self.attention(x_BND, ctx)
            x_BND = self.attn_norm(x_BND + self.dropout(attn.hidden_BND))
            x_BND = self.ffn_norm(x_BND + self._ffn(x_BND))
        elif self.residual == "pre_ln":
            attn = self.attention(self.attn_norm(x_BND), ctx)
            x_BND = x_BND + self.dropout(attn.hidden_BND)
            x_BND = x_BND + self._ffn(self.ffn_norm(x_BND))
        else:  # rezero
            alpha = ctx.residual_gate
            attn = self.attention(x_BND, ctx)
            x_BND = x_BND + alpha * self.dropout(attn.hidden_BND)
            x_BND = x_BND + alpha * self._ffn(x_BND)
        return x_BND, attn.aux_losses


@dataclass
class EncoderOutput:
    last_hidden_state: Tensor
    """(B, N, d) final hidden states."""
    pooled_output: Tensor
    """(B, d) ALBERT pooler: tanh(W h_[CLS])."""
    hidden_states: tuple[Tensor, ...] | None = None
    """(L + 1) x (B, N, d): the projected embeddings, then the output of each group application."""
    aux_losses: AuxLosses = field(default_factory=dict)
    """Weighted auxiliary losses by name; the trainer adds their sum to the task loss."""


class Encoder(nn.Module):
    """input ids (B, N) + attention mask (B, N) -> EncoderOutput."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.config = cfg
        family = ATTENTION_REGISTRY.get(cfg.attention)
        self.embeddings = (family.embeddings or AlbertEmbeddings)(cfg)
        make_layer = family.layer or EncoderLayer
        self.groups = nn.ModuleList(
            nn.ModuleList(make_layer(cfg) for _ in range(cfg.inner_group_num))
            for _ in range(cfg.num_hidden_groups)
        )
        self.schedule = cfg.group_schedule()
        gate_init = make_layer.residual_gate_init(cfg)
        self.residual_gates = (
            nn.Parameter(torch.full((cfg.num_layer_applications,), float(gate_init)))
            if gate_init is not None
            else None
        )
        self.family_state = family.state(cfg) if family.state else None
        # A state may take the host-side padding flag as a third argument (TISA's does).
        self._state_takes_padded = self.family_state is not None and (
            "padded" in inspect.signature(self.family_state.forward).parameters
        )
        self.final_norm = (
            layer_norm(cfg, cfg.hidden_size)
            if cfg.residual == "pre_ln" and family.layer is None
            else None
        )
        self.pooler = make_linear(cfg, cfg.hidden_size, cfg.hidden_size)
        self.checkpoint_fn: Callable | None = None
        self.apply(functools.partial(init_weights, std=cfg.initializer_range))

    @property
    def compile_auto(self) -> bool:
        """Whether ``engine.compile: auto`` compiles this encoder on a GPU (its attention
        family's ``compile_auto``)."""
        return ATTENTION_REGISTRY.get(self.config.attention).compile_auto

    def enable_activation_checkpointing(self, checkpoint_fn: Callable | None = None) -> None:
        """Recompute each layer application in backward. Default: torch's non-reentrant checkpoint."""
        if checkpoint_fn is None:
            checkpoint_fn = functools.partial(
                torch.utils.checkpoint.checkpoint, use_reentrant=False
            )
        self.checkpoint_fn = checkpoint_fn

    def layer_applications(self):
        """Yields (application index, layer module) in execution order."""
        index = 0
        for group_id in self.schedule:
            for layer in self.groups[group_id]:
                yield index, layer
                index += 1

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        output_hidden_states: bool = False,
    ) -> EncoderOutput:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        mask_BN = key_mask(input_ids, attention_mask)
        padded = batch_is_padded(attention_mask)
        # Each orthogonal map is evaluated once per forward, whatever the number of applications.
        with orthogonal_cache():
            return self._forward(input_ids, mask_BN, padded, token_type_ids, output_hidden_states)

    @torch.no_grad()
    def trace(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> list[tuple[Tensor, LayerContext]]:
        """(input hidden states, context) of every layer application, then (final states, None).

        The first entry's states are the embeddings' output h_0. Used by `model.diagnostics`.
        """
        mask_BN = key_mask(input_ids, attention_mask)
        padded = batch_is_padded(attention_mask)
        steps: list[tuple[Tensor, LayerContext | None]] = []
        with orthogonal_cache():
            out = self._forward(input_ids, mask_BN, padded, token_type_ids, False, steps)
        steps.append((out.last_hidden_state, None))
        return steps

    def _forward(
        self, input_ids, mask_BN, padded, token_type_ids, output_hidden_states, trace=None
    ) -> EncoderOutput:
        store = active_orthogonal_cache()
        checkpointing = self.checkpoint_fn is not None and self.training
        # Every orthogonal map up front, those of one shape in one batched solve (CUDA): before
        # the first checkpointed region, so forward and recomputation find the same matrices
        # (same saved tensors); and one factorisation instead of one per map. In inference
        # (no grad) the maps are evaluated lazily, reusing the matrices kept across forwards.
        if checkpointing or torch.is_grad_enabled():
            evaluate_orthogonal_maps(self, store, required=checkpointing)
        # The fused Q/K/V weights too, once per forward (not per application of a shared layer).
        cache_fused_qkv(self, store, input_ids.device.type)
        x_BND = self.embeddings(input_ids, token_type_ids)
        aux: AuxLosses = {}
        extras = {}
        if self.family_state is not None:
            if self._state_takes_padded:
                extras, state_aux = self.family_state(x_BND, mask_BN, padded=padded)
            else:
                extras, state_aux = self.family_state(x_BND, mask_BN)
            add_aux(aux, state_aux)
        hidden_states = [x_BND] if output_hidden_states else None
        inner = self.config.inner_group_num
        used: set[int] = set()
        for index, layer in self.layer_applications():
            gate = self.residual_gates[index] if self.residual_gates is not None else None
            ctx = LayerContext(
                mask_BN=mask_BN,
                layer_index=index,
                first_use=id(layer) not in used,
                residual_gate=gate,
                extras=extras,
                padded=padded,
            )
            used.add(id(layer))
            if trace is not None:
                trace.append((x_BND, ctx))
            if checkpointing:
                run = functools.partial(_run_layer_with_cache, layer, store)
                x_BND, layer_aux = self.checkpoint_fn(run, x_BND, ctx)
            else:
                x_BND, layer_aux = layer(x_BND, ctx)
            add_aux(aux, layer_aux)
            if hidden_states is not None and (index + 1) % inner == 0:
                hidden_states.append(x_BND)
        if self.final_norm is not None:
            x_BND = self.final_norm(x_BND)
            if hidden_states is not None:
                hidden_states[-1] = x_BND
        pooled_BD = torch.tanh(self.pooler(x_BND[:, 0]))
        return EncoderOutput(
            last_hidden_state=x_BND,
            pooled_output=pooled_BD,
            hidden_states=tuple(hidden_states) if hidden_states is not None else None,
            aux_losses=aux,
        )


def _run_layer_with_cache(layer: nn.Module, store: dict, x_BND: Tensor, ctx: LayerContext):
    """Runs a layer inside the forward's orthogonal cache (also when checkpointing recomputes it).

    In the forward the cache is already active and is left alone: entering it again would be a
    side effect inside the checkpointed region, which torch.compile cannot trace (its recompute
    replays the traced graph, no Python, so it needs no cache).
    """
    if active_orthogonal_cache() is store:
        return layer(x_BND, ctx)
    with orthogonal_cache(store):  # eager recompute in backward: the forward's block has closed
        return layer(x_BND, ctx)


def init_weights(module: nn.Module, std: float) -> None:
    """BERT/ALBERT init: N(0, std) weights, zero biases, unit LayerNorm. Skips orthogonal weights
    (their parametrization sets them) and modules that define their own `init_parameters`."""
    if hasattr(module, "init_parameters"):
        module.init_parameters()
        return
    if isinstance(module, nn.Linear):
        if not is_orthogonal_parametrized(module):
            nn.init.normal_(module.weight, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        if not parametrize.is_parametrized(module, "weight"):
            nn.init.normal_(module.weight, std=std)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
