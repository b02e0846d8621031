"""Typed model configuration: `EncoderConfig`, plus named presets.

Each attention family's settings are a section of the config (`model.tisa.num_kernels`,
`cfg.tisa`) whose class the family declares in its own file (`AttentionFamily.options`, e.g.
`model.attention.tisa.TISAConfig`): the config finds them through the attention registry when
it is parsed and imports no family (`model.typed_config.with_sections`).

Every field is documented where it is declared. Configs validate themselves at construction
(`__post_init__`) and raise `ValueError` naming the field and the valid values, so a typo in a
recipe fails at start-up, never deep in a run.

The generic dict <-> dataclass helpers (`config_from_dict`, which rejects unknown keys with a
"did you mean" hint, `config_to_dict`, `deep_merge`, the `_check_*` field checks) live in
`model.typed_config`; they are imported here, so `model.config.config_from_dict` and friends
keep working.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from model.typed_config import (
    SECTIONS,
    _check_choice,
    _check_positive,
    _check_prob,
    config_from_dict,
    config_to_dict,
    deep_merge,
    with_sections,
)

ResidualStyle = Literal["post_ln", "pre_ln", "rezero"]
PositionEmbedding = Literal["absolute", "none"]
OrthogonalMap = Literal["matrix_exp", "cayley", "householder"]
CayleyLeafInverse = Literal["lu", "gauss_jordan"]
AutocastOutput = Literal["compute", "fp32"]
"""What an activation is kept in under autocast: the autocast dtype (bf16), or fp32."""

_ACTIVATIONS = ("gelu_new", "gelu", "relu", "silu")


SIZE_FIELDS = (
    "vocab_size",
    "embedding_size",
    "hidden_size",
    "num_hidden_layers",
    "num_hidden_groups",
    "inner_group_num",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
    "type_vocab_size",
)
"""The encoder's sizes: positive integers that fix the shapes of its tensors."""


def _family_options() -> dict[str, type]:
    """{config key: options class} of the registered attention families, read at parse time:
    the registry imports no family, and the families (which import this module) register when
    `model.attention` is imported, before any config is built."""
    from model.attention.registry import ATTENTION_REGISTRY

    return ATTENTION_REGISTRY.option_sections()


@with_sections
@dataclass
class EncoderConfig:
    """An ALBERT-style encoder with pluggable attention. Defaults are ALBERT-base v2."""

    vocab_size: int = 30000
    """Number of token ids (ALBERT's SentencePiece vocabulary has 30000)."""

    embedding_size: int = 128
    """e, the width of the factorised token/position/type embeddings before the e -> d map."""

    hidden_size: int = 768
    """d, the width of the hidden states."""

    num_hidden_layers: int = 12
    """L, the number of layer-group applications (depth), whatever the number of distinct weights."""

    num_hidden_groups: int = 1
    """Number of distinct layer groups; application l uses group l * groups // L (ALBERT sharing)."""

    inner_group_num: int = 1
    """Number of distinct layers inside each group, run in sequence at every application."""

    num_attention_heads: int = 12
    """H; hidden_size must be divisible by it (head width h = d / H)."""

    intermediate_size: int = 3072
    """Width of the feed-forward block of the standard (non-TransJect) layers."""

    hidden_act: str = "gelu_new"
    """Feed-forward and MLM-head activation: gelu_new (tanh approximation, ALBERT's), gelu, relu, silu."""

    hidden_dropout_prob: float = 0.0
    """Dropout on embeddings, sublayer outputs and classifier inputs (ALBERT v2: 0)."""

    attention_probs_dropout_prob: float = 0.0
    """Dropout on the softmax attention probabilities (ALBERT v2: 0)."""

    max_position_embeddings: int = 512
    """Rows of the absolute position embedding; the longest input when it is used."""

    type_vocab_size: int = 2
    """Number of token types (segments A/B)."""

    layer_norm_eps: float = 1e-12
    """LayerNorm epsilon."""

    norm_output: AutocastOutput = "compute"
    """What the LayerNorms return under autocast (`engine.precision: bf16-mixed`); they compute in
    fp32 either way. `compute`: their result rounded to the autocast dtype (bf16), so the post-LN
    residual stream between layers and its gradient are bf16, as in Megatron-LM's default; on a
    GPU each compiled step then moves about a quarter fewer bytes outside its products and
    attention (ALBERT-base at 64 x 512: 36.0 instead of 47.9 GB; docs/methods.md). `fp32`: they
    return fp32, torch's autocast rule for layer_norm on CUDA (applied on the CPU too, where
    torch's autocast would keep the input's dtype). No effect without autocast, nor on the
    weights: checkpoints and exports are the same either way."""

    initializer_range: float = 0.02
    """Std of the truncated-normal-free normal init of weights (ALBERT/BERT convention)."""

    pad_token_id: int = 0
    """Token id used for padding (ignored by the model, which takes an explicit attention mask)."""

    position_embedding: PositionEmbedding = "absolute"
    """`absolute`: learned absolute position embeddings (ALBERT). `none`: no absolute positions,
    e.g. TISA alone. TransJect always uses its own concatenated sinusoidal encoding."""

    residual: ResidualStyle = "post_ln"
    """Block residual style for softmax/TISA/kernel layers: `post_ln` (ALBERT), `pre_ln`
    (with a final LayerNorm), `rezero` (x + alpha * f(x), alpha = 0 at init, no LayerNorm).
    TransJect layers always use their injective residual."""

    attention: str = "softmax"
    """Attention family from the registry `model.attention.ATTENTION_REGISTRY`: softmax, tisa,
    kernel, transject."""

    orthogonal: bool = False
    """Orthogonally parameterise every square projection (q, k, v, output, square FFN maps):
    TransJect's "Orthogonal Transformer" ablation, usable with any family."""

    orthogonal_map: OrthogonalMap = "cayley"
    """The map from free parameters to orthogonal matrices (torch's orthogonal parametrization):
    `cayley` (default: accurate in fp32 and the cheapest,
    docs/benchmarks.md#transjects-orthogonal-maps), `matrix_exp` (run in fp64, slower),
    `householder`."""

    cayley_leaf_inverse: CayleyLeafInverse = "lu"
    """How the Cayley map's block inverse inverts its leaf blocks (at most 128 x 128: 96 x 96 at
    d = 768). `lu`: torch's batched LU inverse (`linalg.inv_ex`). `gauss_jordan`: on CUDA one
    Triton kernel per leaf batch, Gauss-Jordan without pivoting in registers (the leaves have
    symmetric parts >= I, so no pivot is small); off CUDA it is `lu`. A batched LU of such small
    matrices is some twenty latency-bound kernels on a GPU, a visible share of TransJect's
    albert-base step on an H100 (docs/benchmarks.md#where-the-device-time-goes). Gauss-Jordan's
    error is within 3x of LU's (both a few 1e-7 at 96 x 96; docs/methods.md); its GPU speed is
    not measured, hence not the default."""

    orthogonal_step_cache: bool = True
    """In training with gradient accumulation, evaluate each orthogonal map (`orthogonal`,
    TransJect) once per optimizer step, forward and backward, instead of once per micro-batch:
    the parameters do not change between a step's micro-batches, and the gradient reaches them
    unchanged (exact to fp32 round-off; docs/methods.md, TransJect;
    `model.orthogonal_step.OrthogonalStepCache`). With `engine.compile` the step's maps are
    evaluated eagerly before the compiled encoder, which takes them as inputs. Not under ZeRO-3
    (partitioned parameters), where the maps are evaluated once per micro-batch forward as with
    this off; without orthogonal maps, or with accumulation 1, there is nothing to cache. Was
    `engine.orthogonal_step_cache` (still read, with a warning)."""

    orthogonal_shard_maps: bool = True
    """In training with several data-parallel ranks, each rank evaluates only its share of the
    orthogonal maps (`orthogonal`, TransJect) in a step and an all-gather hands every rank all
    of them; the gradient comes back through a reduce-scatter to the rank that mapped it, and
    the usual gradient average makes it the unsharded one (exact to fp32 round-off;
    docs/methods.md, TransJect; `model.orthogonal_step`). Map work per rank drops by the number
    of ranks, for one all-gather and one reduce-scatter of the matrices per step. Combines with
    `orthogonal_step_cache` (maps once per step, sharded) and with `engine.compile` (the maps
    evaluated eagerly before the compiled encoder); not under ZeRO-3. Maps of one shape fewer
    than the ranks, or smaller than `orthogonal_shard_min_size`, are evaluated by all. Was
    `engine.orthogonal_shard_maps` (still read, with a warning)."""

    orthogonal_shard_min_size: int = 256
    """`orthogonal_shard_maps` shares out only matrices whose both sides are at least this long;
    smaller ones cost less to map than the collectives (2 CPU ranks: 64 x 64 maps were slower
    sharded, 128 x 128 even, 256 x 256 faster; on a GPU a batched solve of small matrices costs
    about the same whatever their number). 0 shares out every size. Was
    `engine.orthogonal_shard_min_size` (still read, with a warning)."""

    family_options: dict[str, Any] = field(
        default_factory=dict, metadata={SECTIONS: _family_options}
    )
    """Each attention family's settings, under the key its `AttentionFamily.options` class is
    registered with (`tisa`, `kernel`, `transject`, a plugin's own), written and read as a
    top-level key: `model.tisa.num_kernels` in a recipe, `cfg.tisa.num_kernels` in code."""

    def __post_init__(self) -> None:
        for name in SIZE_FIELDS:
            _check_positive(name, getattr(self, name))
        _check_prob("hidden_dropout_prob", self.hidden_dropout_prob)
        _check_prob("attention_probs_dropout_prob", self.attention_probs_dropout_prob)
        _check_positive("layer_norm_eps", self.layer_norm_eps)
        _check_positive("initializer_range", self.initializer_range, allow_zero=True)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.num_hidden_groups > self.num_hidden_layers:
            raise ValueError(
                f"num_hidden_groups={self.num_hidden_groups} exceeds "
                f"num_hidden_layers={self.num_hidden_layers}: some groups would never run"
            )
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id={self.pad_token_id} outside [0, vocab_size)")
        _check_choice("hidden_act", self.hidden_act, _ACTIVATIONS)
        _check_choice("position_embedding", self.position_embedding, ("absolute", "none"))
        _check_choice("residual", self.residual, ("post_ln", "pre_ln", "rezero"))
        _check_choice(
            "orthogonal_map", self.orthogonal_map, ("matrix_exp", "cayley", "householder")
        )
        _check_choice("cayley_leaf_inverse", self.cayley_leaf_inverse, get_args(CayleyLeafInverse))
        for name in ("orthogonal_step_cache", "orthogonal_shard_maps"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid; valid: true, false")
        size = self.orthogonal_shard_min_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(
                f"orthogonal_shard_min_size={size!r} is invalid; valid: an integer >= 0"
            )
        _check_choice("norm_output", self.norm_output, get_args(AutocastOutput))
        # The registry imports no family; the families, which import this module, register
        # there when `model.attention` is imported (before any config is built).
        from model.attention.registry import ATTENTION_REGISTRY

        family = ATTENTION_REGISTRY.get(self.attention)  # ValueError naming the valid ones
        if family.validate is not None:
            family.validate(self)

    @property
    def head_dim(self) -> int:
        """h = d / H."""
        return self.hidden_size // self.num_attention_heads

    @property
    def num_layer_applications(self) -> int:
        """How many layers the input passes through: num_hidden_layers * inner_group_num."""
        return self.num_hidden_layers * self.inner_group_num

    def group_schedule(self) -> list[int]:
        """The group index run at each of the num_hidden_layers applications (ALBERT sharing)."""
        L, G = self.num_hidden_layers, self.num_hidden_groups
        return [layer * G // L for layer in range(L)]

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EncoderConfig:
        """Builds a config from a dict; a `preset` key starts from that preset (the other keys
        override it), as in the YAML files under `configs/model/`; `preset: null` is none (an
        override that drops a recipe's preset, e.g. for a checkpoint that fixes the sizes)."""
        if "preset" in data:
            data = dict(data)
            name = data.pop("preset")
            return config_from_dict(cls, data) if name is None else cls.preset(name, **data)
        return config_from_dict(cls, data)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> EncoderConfig:
        """A named preset (see `PRESETS`) with optional field overrides, nested ones as dicts."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return config_from_dict(cls, deep_merge(PRESETS[name], overrides))


# Named presets. ALBERT v2 sizes from the ALBERT paper / google-research/albert configs.
_ALBERT_BASE: dict[str, Any] = dict(
    embedding_size=128,
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    intermediate_size=3072,
)
PRESETS: dict[str, dict[str, Any]] = {
    "debug": dict(
        vocab_size=512,
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
    ),
    "albert-base": _ALBERT_BASE,
    "albert-large": dict(
        embedding_size=128,
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
    ),
    # Depth presets: one shared group run 48 / 96 times (ALBERT-base width).
    "albert-base-48": {**_ALBERT_BASE, "num_hidden_layers": 48},
    "albert-base-96": {**_ALBERT_BASE, "num_hidden_layers": 96},
}
