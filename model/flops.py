"""Training FLOPs of the encoder and its pretraining heads, for model FLOPs utilisation (MFU).

Legend: N tokens of one sequence, M positions the MLM head decodes, d hidden width, e the MLM
head's width (embedding_size; d/2 for TransJect), I intermediate size, V vocabulary, H heads,
h head width (d / H), r the aoglu gate rank, E TransJect experts, L layer applications
(num_hidden_layers x inner_group_num: ALBERT's sharing saves parameters, not compute).

Convention (PaLM, Chowdhery et al. 2022, appendix B; Megatron-LM, Narayanan et al. 2021): only
matrix products count, 2 m n k FLOPs for an (m, k) x (k, n) product. Ignored:

* elementwise and reduction work: activations, softmax, LayerNorm, dropout, residual adds,
  masking, TISA's positional bias (O(N^2 H) adds), the linear-attention normaliser
  phi(q)^T z (O(N d)), TransJect's gate pooling. Memory-bound and a few % of the total at most;
* embedding lookups (no arithmetic);
* per-step work that does not grow with the batch: evaluating the orthogonal parametrisations
  (O(d^3) per distinct matrix and forward, whatever the batch size; see `model/orthogonal.py`).

Everything is per sequence; multiply by the number of sequences in a step. Padding tokens are
computed like real ones, so `seq_len` is the padded length.

Per family, one layer application (the mixing step, without the Q/K/V/O projections):

    softmax, tisa   Q K^T and A V:                            4 N^2 d
    kernel          phi on q and k (per unit, per head):      2 x units x 2 N h (h [+ h | + 2 r])
                    phi(K)^T V and phi(Q) KV:                 4 N h d
    transject       the whole layer is its own: experts 4 E N d^2, mixture 2 E N d,
                    gate 2 E d, FFN 4 N d^2 (no Q/K/V/O); plus, once per forward, the
                    eigen-state M = X^T X (2 N d^2) and two d x d x d products (4 d^3)

Example: ALBERT-base at N = 512 with a sparse MLM head over 77 positions (15 %):

>>> from model.config import EncoderConfig
>>> cfg = EncoderConfig.preset("albert-base")
>>> round(training_flops(cfg, 512, masked_tokens=77) / 1e9)  # GFLOPs per sequence and step
292
"""

from __future__ import annotations

from collections.abc import Callable

from model.config import EncoderConfig


def matmul_flops(m: int, k: int, n: int) -> int:
    """FLOPs of an (m, k) x (k, n) product: one multiply and one add per term."""
    return 2 * m * k * n


# ----------------------------------------------------------------------------- mixing steps


def softmax_mixing_flops(cfg: EncoderConfig, seq_len: int) -> int:
    """Q K^T and softmax(.) V over all heads: 2 x 2 N N d (TISA's bias is elementwise)."""
    return 2 * matmul_flops(seq_len, cfg.hidden_size, seq_len)


def _feature_map_unit_flops(cfg: EncoderConfig, seq_len: int) -> int:
    """One unit of the kernel feature map phi on one (N, h) input, summed over heads."""
    h, fm = cfg.head_dim, cfg.kernel.feature_map
    if fm == "elu":
        return 0
    per_head = matmul_flops(seq_len, h, h)  # x W
    if fm in ("glu", "oglu"):
        per_head += matmul_flops(seq_len, h, h)  # the gate x V
    elif fm == "aoglu":
        rank = h // cfg.kernel.gate_rank_divisor
        per_head += matmul_flops(seq_len, h, rank) + matmul_flops(seq_len, rank, h)  # x A B
    return cfg.num_attention_heads * per_head


def kernel_mixing_flops(cfg: EncoderConfig, seq_len: int) -> int:
    """phi(q), phi(k) (`num_stacked` units each; none for elu), then phi(K)^T V and phi(Q) KV."""
    units = 0 if cfg.kernel.feature_map == "elu" else cfg.kernel.num_stacked
    phi = 2 * units * _feature_map_unit_flops(cfg, seq_len)  # queries and keys
    h = cfg.head_dim
    linear = cfg.num_attention_heads * 2 * matmul_flops(h, seq_len, h)  # (h, N) x (N, h), twice
    return phi + linear


# ----------------------------------------------------------------------------- layers


def standard_layer_flops(cfg: EncoderConfig, seq_len: int) -> int:
    """One `EncoderLayer` application: Q/K/V/O projections, the family's mixing step, FFN."""
    d, n = cfg.hidden_size, seq_len
    projections = 4 * matmul_flops(n, d, d)
    ffn = matmul_flops(n, d, cfg.intermediate_size) + matmul_flops(n, cfg.intermediate_size, d)
    return projections + _MIXING_FLOPS[cfg.attention](cfg, n) + ffn


def transject_layer_flops(cfg: EncoderConfig, seq_len: int) -> int:
    """One `TransJectLayer` application: E experts X U_e Lambda V_e^T (two d x d products each),
    the gate g on the E pooled vectors, the mixture over experts, the orthogonal d x d FFN."""
    d, n, E = cfg.hidden_size, seq_len, cfg.transject.num_experts
    experts = E * 2 * matmul_flops(n, d, d)
    gate = matmul_flops(E, d, 1)
    mixture = matmul_flops(1, E, n * d)  # sum_e w_e A_e, a contraction over experts
    ffn = 2 * matmul_flops(n, d, d)
    return experts + gate + mixture + ffn


_MIXING_FLOPS: dict[str, Callable[[EncoderConfig, int], int]] = {
    "softmax": softmax_mixing_flops,
    "tisa": softmax_mixing_flops,
    "kernel": kernel_mixing_flops,
}
"""Mixing-step FLOPs of the families that use the standard layer (`MultiHeadAttention`)."""

_LAYER_FLOPS: dict[str, Callable[[EncoderConfig, int], int]] = {
    **dict.fromkeys(_MIXING_FLOPS, standard_layer_flops),
    "transject": transject_layer_flops,
}
"""FLOPs of one layer application, per attention family."""


def layer_flops(cfg: EncoderConfig, seq_len: int) -> int:
    """Matmul FLOPs of one layer application on one sequence of `seq_len` tokens."""
    if cfg.attention not in _LAYER_FLOPS:
        raise ValueError(
            f"no FLOP count for attention={cfg.attention!r}; counted families: "
            f"{sorted(_LAYER_FLOPS)}"
        )
    return _LAYER_FLOPS[cfg.attention](cfg, seq_len)


# ----------------------------------------------------------------------------- the model


def embedding_flops(cfg: EncoderConfig, seq_len: int) -> int:
    """ALBERT's e -> d projection (TransJect's concatenated embedding has no matmul), plus
    TransJect's once-per-forward eigen-state with `eigenvalues="approx"`."""
    d = cfg.hidden_size
    if cfg.attention != "transject":
        return matmul_flops(seq_len, cfg.embedding_size, d)
    if cfg.transject.eigenvalues == "random":
        return 0
    # M = X^T X, M U, (U diag(lambda)) U^T: see `approximate_eigenvalues`.
    return matmul_flops(d, seq_len, d) + 2 * matmul_flops(d, d, d)


def mlm_width(cfg: EncoderConfig) -> int:
    """e: width of the token embedding the MLM decoder is tied to."""
    return cfg.hidden_size // 2 if cfg.attention == "transject" else cfg.embedding_size


def head_flops(cfg: EncoderConfig, seq_len: int, masked_tokens: int | None = None) -> int:
    """MLM head (dense d -> e, decoder e -> V) over `masked_tokens` positions (all `seq_len` when
    None) and the SOP classifier d -> 2 on the pooled [CLS]."""
    m = seq_len if masked_tokens is None else masked_tokens
    e = mlm_width(cfg)
    mlm = matmul_flops(m, cfg.hidden_size, e) + matmul_flops(m, e, cfg.vocab_size)
    sop = matmul_flops(1, cfg.hidden_size, 2)
    return mlm + sop


def _check_lengths(seq_len: int, masked_tokens: int | None) -> None:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} is invalid; valid: an integer >= 1")
    if masked_tokens is not None and (
        isinstance(masked_tokens, bool)
        or not isinstance(masked_tokens, int)
        or not 0 <= masked_tokens <= seq_len
    ):
        raise ValueError(
            f"masked_tokens={masked_tokens!r} is invalid; valid: None (decode every position) "
            f"or an integer in [0, seq_len={seq_len}]"
        )


def forward_flops(
    cfg: EncoderConfig, seq_len: int, *, masked_tokens: int | None = None, heads: bool = True
) -> int:
    """Matmul FLOPs of one forward pass of ONE sequence of `seq_len` tokens.

    Counts the embedding projection (e -> d), every layer application (L of them, shared or not),
    ALBERT's pooler (d -> d on [CLS]) and, with `heads`, the pretraining heads (`head_flops`):
    the MLM decoder runs over `masked_tokens` positions when given (the sparse head of
    `EncoderForPretraining(masked_positions=...)`), else over all `seq_len`. Elementwise work is
    ignored (see the module docstring). `heads=False` is the bare `Encoder`.
    """
    _check_lengths(seq_len, masked_tokens)
    d = cfg.hidden_size
    total = embedding_flops(cfg, seq_len)
    total += cfg.num_layer_applications * layer_flops(cfg, seq_len)
    total += matmul_flops(1, d, d)  # pooler
    if heads:
        total += head_flops(cfg, seq_len, masked_tokens)
    return total


def training_flops(cfg: EncoderConfig, seq_len: int, *, masked_tokens: int | None = None) -> int:
    """Model FLOPs of one training step on ONE sequence: 3 x `forward_flops` (the backward pass
    computes two products, input and weight gradients, per forward product).

    Activation checkpointing's recompute (one more forward) is NOT counted: MFU counts the
    model's FLOPs, not the hardware's (HFU), so that it does not reward recomputation.
    """
    return 3 * forward_flops(cfg, seq_len, masked_tokens=masked_tokens)


__all__ = [
    "embedding_flops",
    "forward_flops",
    "head_flops",
    "kernel_mixing_flops",
    "layer_flops",
    "matmul_flops",
    "mlm_width",
    "softmax_mixing_flops",
    "standard_layer_flops",
    "training_flops",
    "transject_layer_flops",
]
