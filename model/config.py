"""Typed model configuration: `EncoderConfig` and its per-family sub-configs, plus named presets.

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
EigenProducts = Literal["fp32", "bf16x3"]
AutocastOutput = Literal["compute", "fp32"]
"""What an activation is kept in under autocast: the autocast dtype (bf16), or fp32."""

_ACTIVATIONS = ("gelu_new", "gelu", "relu", "silu")


@dataclass
class TransJectConfig:
    """TransJect (Sengupta, Akhtar, Chakraborty 2023); docs/methods.md, TransJect."""

    num_experts: int = 4
    """E, the number of orthogonal attention experts mixed by the per-sample gate."""

    eigenvalues: Literal["approx", "random"] = "approx"
    """`approx`: eigenvalues of X0^T X0 approximated once per forward with a learnable orthogonal
    basis, plus a reconstruction loss. `random`: Random-TransJect, a learned diagonal (no loss)."""

    reconstruction_weight: float = 1e-3
    """Weight of the eigen-reconstruction loss (the authors' code: 1e-3 classification, 0.1 LM).
    The model returns the weighted loss as the auxiliary loss `transject_reconstruction`."""

    reconstruction: Literal["scale_free", "authors"] = "scale_free"
    """The eigen-reconstruction loss. `scale_free` (default): mean((M/s - U diag(lambda) U^T)^2),
    s = max|diag(U^T M U)| the scale that normalises lambda; zero exactly when U is an eigenbasis
    of M, independent of N and of the embedding norm. `authors`: mean((M - U diag(lambda) U^T)^2)
    with the raw M and the normalised lambda, as in the authors' code: measured, it pushes U
    AWAY from the eigenbasis (its minimum spreads diag(U^T M U) evenly; docs/methods.md)."""

    gate_input: Literal["sublayer", "attention"] = "sublayer"
    """What the expert gate max-pools over the real tokens. `sublayer`: each expert's sublayer
    output X + alpha * A_e(X), as in the authors' code (uniform weights at the ReZero init).
    `attention`: A_e(X) alone (this project's earlier reading of the paper)."""

    bias: Literal["lipschitz", "authors", "none"] = "lipschitz"
    """Biases of the expert and FFN maps. `authors`: every bias of the authors' code (the
    expert's U and V maps, the FFN's two maps), nn.Linear's default init. `lipschitz` (default):
    the same except V's bias, the one that breaks the paper's Lipschitz bound (it adds
    (sum of the features of X U) * b_V to every token). `none`: no bias anywhere."""

    token_embedding: Literal["auto", "orthogonal", "plain"] = "auto"
    """The d/2-wide token embedding. `orthogonal`: rows orthonormal (needs vocab_size <= d/2);
    `plain`: an ordinary embedding; `auto`: orthogonal when the vocabulary fits, else plain."""

    residual_init: float = 0.0
    """Initial r_l of the injective residual weight alpha_l = tanh(r_l) / L (0: ReZero, as in the
    authors' code, so every layer starts as the identity)."""

    eigen_products: EigenProducts = "fp32"
    """How the eigen-state's two matrix products (X U and the Gram matrix of the embeddings,
    forward and backward) run; the eigen-state itself is fp32 either way (docs/methods.md).
    `fp32` (default): fp32 products, which a GPU runs on its CUDA cores (about 7.6 ms of the
    albert-base step at seq 512, micro-batch 64, on an H100). `bf16x3`: each fp32 operand split
    into bf16 high and low halves and each product summed from three bf16 products with fp32
    accumulation (the low x low term, about 2^-16 of the rest, left out), on tensor cores; the
    eigenvalues and the reconstruction loss within about 1e-5 of fp32's (docs/methods.md).
    Off CUDA the three products run as fp32 products of the halves (the same values)."""

    residual_stream: AutocastOutput = "fp32"
    """The dtype of the residual stream between TransJect layers under autocast
    (`engine.precision: bf16-mixed`). `fp32` (default): as torch's autocast leaves it, and as the
    authors' code runs: the fp32 embeddings plus each layer's bf16 update stay fp32 (TransJect
    has no LayerNorm that would round it). `compute`: each layer's output rounded to the
    autocast dtype (bf16), as a post-LN ALBERT layer's is (`norm_output: compute`); a compiled
    albert-base step then moves 51.0 instead of 58.9 GB outside its products (docs/methods.md,
    TransJect). No effect without autocast."""

    def __post_init__(self) -> None:
        _check_positive("transject.num_experts", self.num_experts)
        _check_choice("transject.eigenvalues", self.eigenvalues, ("approx", "random"))
        _check_positive("transject.reconstruction_weight", self.reconstruction_weight, True)
        _check_choice(
            "transject.token_embedding", self.token_embedding, ("auto", "orthogonal", "plain")
        )
        _check_choice("transject.reconstruction", self.reconstruction, ("authors", "scale_free"))
        _check_choice("transject.gate_input", self.gate_input, ("sublayer", "attention"))
        _check_choice("transject.bias", self.bias, ("lipschitz", "authors", "none"))
        _check_choice("transject.eigen_products", self.eigen_products, get_args(EigenProducts))
        _check_choice("transject.residual_stream", self.residual_stream, get_args(AutocastOutput))


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
    `cayley` (default: accurate in fp32, about 1e-6 at d=768, and the cheapest), `matrix_exp` (run in
    fp64, 2.5x slower on CPU), `householder`."""

    cayley_leaf_inverse: CayleyLeafInverse = "lu"
    """How the Cayley map's block inverse inverts its leaf blocks (at most 128 x 128: 96 x 96 at
    d = 768). `lu`: torch's batched LU inverse (`linalg.inv_ex`). `gauss_jordan`: on CUDA one
    Triton kernel per leaf batch, Gauss-Jordan without pivoting in registers (the leaves have
    symmetric parts >= I, so no pivot is small); off CUDA it is `lu`. A batched LU of such small
    matrices is some twenty latency-bound kernels on a GPU: on an H100 the leaves took 5.3 ms of
    TransJect's albert-base step. Gauss-Jordan's error is within 3x of LU's (both a few 1e-7 at
    96 x 96; docs/methods.md); its GPU speed is not measured yet, hence not the default."""

    family_options: dict[str, Any] = field(
        default_factory=dict, metadata={SECTIONS: _family_options}
    )
    """Each attention family's settings, under the key its `AttentionFamily.options` class is
    registered with (`tisa`, `kernel`, `transject`, a plugin's own), written and read as a
    top-level key: `model.tisa.num_kernels` in a recipe, `cfg.tisa.num_kernels` in code."""

    transject: TransJectConfig = field(default_factory=TransJectConfig)
    """Settings of the `transject` family (ignored by the others)."""

    def __post_init__(self) -> None:
        # Nested sub-configs may arrive as dicts (e.g. from YAML through dataclasses.replace).
        for name, cls in (("transject", TransJectConfig),):
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, config_from_dict(cls, value, prefix=name))
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
