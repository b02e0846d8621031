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

Each family gives its own count through its `AttentionFamily` entry (`mixing_flops`, or
`layer_flops` and `embedding_flops` for a family with its own layer and embeddings, in its own
file). A family registered without them is not counted (`counts_flops` is False; training then
logs no MFU). The built-in families, one layer application (the mixing step, without the
Q/K/V/O projections):

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

from model.attention import ATTENTION_REGISTRY
from model.attention.base import AttentionFamily, matmul_flops
from model.config import EncoderConfig


class FlopsNotCounted(ValueError):
    """The config's attention family gives no FLOP count (a family registered without
    ``mixing_flops`` / ``layer_flops``): training goes on without an MFU figure."""


def _family(cfg: EncoderConfig) -> AttentionFamily:
    return ATTENTION_REGISTRY.get(cfg.attention)


def counts_flops(cfg: EncoderConfig) -> bool:
    """Whether `forward_flops` / `training_flops` can count this config's family."""
    family = _family(cfg)
    if family.layer is not None and family.layer_flops is None:
        return False
    if family.kernel is not None and family.mixing_flops is None:
        return False
    return family.embeddings is None or family.embedding_flops is not None


def _not_counted(cfg: EncoderConfig, hook: str) -> FlopsNotCounted:
    return FlopsNotCounted(
        f"no FLOP count for attention={cfg.attention!r}: its AttentionFamily gives no "
        f"{hook}= (register it with one to get MFU)"
    )


# ----------------------------------------------------------------------------- layers


def standard_layer_flops(cfg: EncoderConfig, seq_len: int) -> int:
    """One `EncoderLayer` application: Q/K/V/O projections, the family's mixing step, FFN."""
    mixing = _family(cfg).mixing_flops
    if mixing is None:
        raise _not_counted(cfg, "mixing_flops")
    d, n = cfg.hidden_size, seq_len
    projections = 4 * matmul_flops(n, d, d)
    ffn = matmul_flops(n, d, cfg.intermediate_size) + matmul_flops(n, cfg.intermediate_size, d)
    return projections + mixing(cfg, n) + ffn


def layer_flops(cfg: EncoderConfig, seq_len: int) -> int:
    """Matmul FLOPs of one layer application on one sequence of `seq_len` tokens: the standard
    layer around the family's mixing step, or the family's own layer."""
    family = _family(cfg)
    if family.layer is None:
        return standard_layer_flops(cfg, seq_len)
    if family.layer_flops is None:
        raise _not_counted(cfg, "layer_flops")
    return family.layer_flops(cfg, seq_len)


# ----------------------------------------------------------------------------- the model


def embedding_flops(cfg: EncoderConfig, seq_len: int) -> int:
    """ALBERT's e -> d projection, or the family's own embeddings and once-per-forward state
    (TransJect: no matmul in the embedding, the eigen-state with ``eigenvalues="approx"``)."""
    family = _family(cfg)
    if family.embeddings is None:
        return matmul_flops(seq_len, cfg.embedding_size, cfg.hidden_size)
    if family.embedding_flops is None:
        raise _not_counted(cfg, "embedding_flops")
    return family.embedding_flops(cfg, seq_len)


def mlm_width(cfg: EncoderConfig) -> int:
    """e: width of the token embedding the MLM decoder is tied to."""
    width = _family(cfg).token_embedding_width
    return cfg.embedding_size if width is None else width(cfg)


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
    "FlopsNotCounted",
    "counts_flops",
    "embedding_flops",
    "forward_flops",
    "head_flops",
    "layer_flops",
    "matmul_flops",
    "mlm_width",
    "standard_layer_flops",
    "training_flops",
]
