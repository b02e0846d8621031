"""TISA: translation-invariant self-attention (Wennberg & Henter 2021, https://arxiv.org/abs/2106.01950).

Legend: B batch, N tokens, H heads, h head width, S kernels per head, M = 2N - 1 offsets,
L number of layer applications (num_layer_applications), P number of scorers (1 or L).

Each head adds a learned function of the relative offset k = j - i (key position minus query
position) to its attention logits:

    f(k) = sum_{s=1..S} a_s * exp(-|b_s| * (k - c_s)^2)
    att  = softmax(Q K^T / sqrt(h) + F_P + key_padding) V,    F_P[i, j] = f(j - i)

F_P is Toeplitz, so one forward needs f at only M = 2N - 1 offsets per head. `TISAState` computes
those once per forward (docs/methods.md, TISA); every `TISAKernel` then applies them either as an
(H, N, N) bias built by indexing (`sdpa` backend) or inside FlexAttention as a `score_mod`
(`flex` backend, no N x N tensor in memory). On the flex path the `score_mod` is one gather from
the (H, 2N - 1) table and an add, with no branch on the data; the key padding is a FlexAttention
block mask (`key_padding_block_mask`: key blocks of padding only are skipped, the mask is read
only in blocks that mix real keys and padding), and an unpadded batch has no mask at all.
With `tisa.flex_bias: dense` the `score_mod` reads an fp32 (H, N, N) bias made from that table
instead (no batch dimension), which spreads the backward's atomic adds over N^2 entries per head
instead of 2N - 1. `tisa.backend: split` runs SDPA with F_P detached and takes the gradient of
f's values from kernels of its own (tisa_split.py). `tisa.backend: auto` picks the backend per
sequence length (`select_backend`).

Decision (docs/methods.md): we use the paper's convention F_P[i, j] = f(j - i). The authors' code
indexes f(i - j - 1), which is only a reparameterisation (c -> -c - 1), but plots of f here are
on the paper's axis.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.attention.base import (
    AttentionFamily,
    AuxLosses,
    FamilyState,
    LayerContext,
    ScoreKernel,
    compute_dtype,
    key_padding_bias,
)
from model.attention.hf_export import HFExport, family_code
from model.attention.softmax import softmax_mixing_flops
from model.attention.tisa_split import offset_index, split_attention
from model.config import EncoderConfig
from model.typed_config import _check_choice, _check_positive


@dataclass
class TISAConfig:
    """Translation-invariant self-attention (Wennberg & Henter 2021); docs/methods.md, TISA."""

    num_kernels: int = 5
    """S, the number of radial-basis kernels per head in f(k) = sum_s a_s exp(-|b_s| (k - c_s)^2)."""

    scope: Literal["shared", "per_layer"] = "shared"
    """`shared`: one scorer (3*S*H parameters) for every layer application, the TISA authors'
    setup under ALBERT sharing. `per_layer`: one scorer per layer application (num_hidden_layers x
    inner_group_num scorers), so positional scoring can differ with depth even when layer weights are shared."""

    init: Literal["random", "zero_amplitude"] = "random"
    """`random`: the authors' init, c ~ N(0, 5^2), a ~ N(0.1, 0.01^2), b ~ N(0.1, 0.01^2).
    `zero_amplitude`: same, but a = 0 so adding TISA to a pretrained model leaves its outputs
    unchanged at step 0 (the paper's GLUE protocol on albert-base-v2)."""

    backend: Literal["auto", "sdpa", "flex", "split"] = "auto"
    """How the positional score reaches the softmax. `sdpa`: an (H, N, N) float bias built from
    the 2N-1 values of f per head (plus the key padding, when the batch is padded), passed to
    scaled_dot_product_attention. `flex`: FlexAttention with a score_mod adding f(j - i) and the
    key padding in a block mask (no N x N tensor in memory; CUDA, or CPU without gradients,
    where eager flex still materialises the scores). `split`: SDPA with the same bias but
    detached, so that the flash / cuDNN kernels, which return no gradient for a bias, stay
    eligible; the gradient of f's 2N-1 values comes from a Triton kernel of its own (summing the
    scores' gradients along each diagonal in registers, no atomics; off CUDA a dense reference
    computes it). No attention dropout (falls back to sdpa, with a warning). Its speed on a GPU
    is not measured (`python -m bench.bench_fast_paths tisa-backends` times it). `auto`: per
    sequence length, flex on CUDA when attention dropout is off and N >= `flex_min_length`, else
    sdpa."""

    flex_min_length: int = 2048
    """With `backend: auto` on CUDA: the shortest sequence length that uses FlexAttention; shorter
    batches use SDPA with the materialised bias, whose (B, H, N, N) tensor is affordable there.
    The length from which flex is the faster, padded or not, measured on an H100
    (docs/benchmarks.md#tisa); re-measure (`python -m bench.bench_fast_paths tisa-backends`) for
    other widths or batch sizes."""

    flex_bias: Literal["table", "dense"] = "table"
    """How the flex backend's `score_mod` reads f (training on CUDA; the outputs are the same).
    `table`: from the (H, 2N - 1) table of f's values, no N x N tensor at all; its backward
    adds the gradient of every score to the table with an atomic, so the 2N - 1 entries of a
    head are each hit by all the scores on their diagonal (B (N - |k|) of them, many at once).
    `dense`: from the (H, N, N) fp32 bias built from that table once per forward (H N^2 x 4
    bytes: 12.6 MB at N = 512, 805 MB at 4096, for 12 heads; no batch dimension); the backward
    adds each score's gradient to its own entry, the B samples of a batch being the only
    scores that share one, and the (H, N, N) gradient then goes to the table by the indexing's
    backward. The bias and its gradient grow as N^2 (3.2 GB each at 8192 tokens): `dense` is for
    the shorter lengths, the table for long ones. FlexAttention stages the bias's fp32 tiles in
    shared memory: with torch's three pipeline stages its forward did not compile on an H100
    (more than a block may have: docs/benchmarks.md#the-recipes-compiled), so `dense` asks for
    two. Which is faster on a GPU is not measured (`python -m bench.bench_fast_paths
    tisa-backends` times both)."""

    def __post_init__(self) -> None:
        _check_positive("tisa.num_kernels", self.num_kernels)
        _check_choice("tisa.scope", self.scope, ("shared", "per_layer"))
        _check_choice("tisa.init", self.init, ("random", "zero_amplitude"))
        _check_choice("tisa.backend", self.backend, ("auto", "sdpa", "flex", "split"))
        _check_choice("tisa.flex_bias", self.flex_bias, ("table", "dense"))
        _check_positive("tisa.flex_min_length", self.flex_min_length)


class PositionScorer(nn.Module):
    """f(k) = sum_s a_s exp(-|b_s| (k - c_s)^2) for every head; a, b, c are (S, H) parameters.

    k = j - i is the key position minus the query position (the paper's convention, arXiv
    2106.01950), not the f(i - j - 1) indexing of the authors' code.
    """

    def __init__(self, num_kernels: int, num_heads: int, init: str = "random"):
        super().__init__()
        self.a = nn.Parameter(torch.empty(num_kernels, num_heads))  # amplitudes
        self.b = nn.Parameter(torch.empty(num_kernels, num_heads))  # sharpness, used as |b|
        self.c = nn.Parameter(torch.empty(num_kernels, num_heads))  # centres (offsets)
        self.zero_amplitude = init == "zero_amplitude"
        self.init_parameters()

    @torch.no_grad()
    def init_parameters(self) -> None:
        """The authors' init: c ~ N(0, 5^2), a ~ N(0.1, 0.01^2), b ~ N(0.1, 0.01^2); a = 0 with
        `zero_amplitude` (adding TISA to a pretrained model leaves its outputs unchanged)."""
        nn.init.normal_(self.c, mean=0.0, std=5.0)
        nn.init.normal_(self.b, mean=0.1, std=0.01)
        if self.zero_amplitude:
            nn.init.zeros_(self.a)
        else:
            nn.init.normal_(self.a, mean=0.1, std=0.01)

    def score(self, offsets: Tensor | list[float]) -> Tensor:
        """f at arbitrary (integer or real) offsets k = j - i: (K,) -> (H, K)."""
        k_K = torch.as_tensor(offsets, dtype=self.a.dtype, device=self.a.device).reshape(-1)
        a_SH1, b_SH1, c_SH1 = (p.unsqueeze(-1) for p in (self.a, self.b, self.c))
        return (a_SH1 * torch.exp(-b_SH1.abs() * (k_K - c_SH1) ** 2)).sum(0)

    def values(self, N: int) -> Tensor:
        """f at k = -(N-1) .. N-1: (H, 2N-1), offset k at index k + N - 1."""
        return self.score(torch.arange(-(N - 1), N, device=self.a.device))


def toeplitz_bias(values_HM: Tensor) -> Tensor:
    """(H, 2N-1) values of f -> the (H, N, N) bias F_P[h, i, j] = f_h(j - i), by indexing."""
    N = (values_HM.size(-1) + 1) // 2
    return values_HM[:, offset_index(N, values_HM.device)]  # [i, j] -> (j - i) + N - 1


def select_backend(
    cfg: EncoderConfig, device: torch.device, dropout_active: bool, seq_len: int | None = None
) -> str:
    """The backend one kernel call uses: "sdpa", "flex" or "split" (see `TISAConfig.backend`).

    `auto` takes flex on CUDA when attention dropout is off (flex has no dropout) and the
    sequence is at least `tisa.flex_min_length` long (None: long enough), else sdpa. An
    explicit `flex` or `split` with active dropout falls back to sdpa (the kernel warns once;
    neither has a dropout of its own); explicit `flex` on CPU with gradients enabled raises,
    since FlexAttention has no CPU backward.
    """
    backend = cfg.tisa.backend
    if backend == "auto":
        long_enough = seq_len is None or seq_len >= cfg.tisa.flex_min_length
        return "flex" if device.type == "cuda" and not dropout_active and long_enough else "sdpa"
    if backend == "flex" and not dropout_active:
        if device.type != "cuda" and torch.is_grad_enabled():
            raise ValueError(
                f"tisa.backend='flex' cannot run with gradients enabled on {device.type}: "
                "FlexAttention has no backward pass there. Use tisa.backend='sdpa' or 'auto', "
                "or run under torch.no_grad()."
            )
        return "flex"
    if backend == "split" and not dropout_active:
        return "split"
    return "sdpa"


@functools.cache
def _compiled_flex_attention():
    """FlexAttention compiled once per process, lazily (on CUDA, eager flex materialises the
    scores). Every call passes a new `score_mod` closure over new tensors; Dynamo guards on the
    closure's code, not on the tensors' values, so that does not recompile (see
    tests/model/test_fast_paths.py). A new sequence length recompiles once, then shapes are dynamic."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def tisa_score_mod(values_HM: Tensor):
    """The FlexAttention `score_mod` adding f_h(j - i): one gather from the (H, 2N - 1) table.

    values_HM holds f at offsets -(N-1) .. N-1 (offset k at index k + N - 1), a captured tensor
    (a graph input under torch.compile, not a constant). No data-dependent branch: the key
    padding is in the block mask (`key_padding_block_mask`).
    """
    N = (values_HM.size(-1) + 1) // 2

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + values_HM[h, kv_idx - q_idx + N - 1]

    return score_mod


def flex_dense_bias(values_HM: Tensor) -> Tensor:
    """F_P as `tisa.flex_bias: dense` reads it: the (H, N, N) `toeplitz_bias` of the table, in
    fp32 whatever the weights' dtype (FlexAttention adds the scores' gradients into it with
    atomics, which a bf16 tensor would round at every add)."""
    return toeplitz_bias(values_HM.float())


def tisa_dense_score_mod(bias_HNN: Tensor):
    """The FlexAttention `score_mod` adding F_P[h, i, j] = f_h(j - i) from the (H, N, N) bias
    (`toeplitz_bias`, `tisa.flex_bias: dense`): one read per score, and in the backward one
    atomic add per score onto its own entry (the table's `tisa_score_mod` sends all the scores of
    a diagonal to one entry)."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias_HNN[h, q_idx, kv_idx]

    return score_mod


FLEX_BLOCK_SIZE = 128
"""FlexAttention's default sparse block size (`_DEFAULT_SPARSE_BLOCK_SIZE`)."""

DENSE_FLEX_KERNEL_OPTIONS = {"num_stages": 2}
"""FlexAttention's `kernel_options` on the dense bias (`tisa.flex_bias: dense`): two pipeline
stages instead of the three of torch's defaults for an H100. The kernel stages each tile of the
fp32 bias it reads in shared memory like the q, k and v tiles; with torch 2.11's H100 defaults
(forward 128 x 128 tiles, 3 stages) that is 3 x 64 KB of bias + 96 KB of k, v + 16 KB of q =
304 KB, over the 227 KB a block may have: on an H100 the forward did not compile
(docs/benchmarks.md#the-recipes-compiled). With two stages the forward needs 208 KB (the
backward's tiles are smaller). The table's `score_mod` gathers single values, which are not
staged, and keeps torch's defaults. Whether the dense bias then runs faster than the table is
measured on a GPU."""


def key_padding_block_mask(mask_BN: Tensor, block_size: int = FLEX_BLOCK_SIZE):
    """The FlexAttention `BlockMask` of a key-padding mask (B, N), True at real keys, built in
    O(B (N / block)^2) from the mask itself (no N x N tensor, no host sync).

    It equals `create_block_mask(lambda b, h, q, kv: mask_BN[b, kv], B, None, N, N)` (tested):
    a (query block, key block) pair is *empty* (skipped) when the key block holds padding only,
    *full* (the mask is not read) when every key of the block is real and the query block lies
    inside the sequence, and *partial* (the `mask_mod` reads the mask) otherwise.
    """
    from torch.nn.attention.flex_attention import BlockMask

    B, N = mask_BN.shape
    num_blocks = -(-N // block_size)
    grid_BM = torch.cat([mask_BN, mask_BN.new_zeros(B, num_blocks * block_size - N)], dim=1)
    real_keys_BK = grid_BM.view(B, num_blocks, block_size).sum(-1)
    q_inside_Q = (torch.arange(1, num_blocks + 1, device=mask_BN.device) * block_size) <= N
    full_BQK = (real_keys_BK == block_size)[:, None, :] & q_inside_Q[None, :, None]
    partial_BQK = (real_keys_BK > 0)[:, None, :] & ~full_BQK

    def ordered(dense_BQK: Tensor) -> tuple[Tensor, Tensor]:
        """(number of blocks per row, their key-block indices first) as `BlockMask` wants."""
        dense_B1QK = dense_BQK[:, None].to(torch.int32)
        count = dense_B1QK.sum(-1).to(torch.int32)
        order = torch.argsort(dense_B1QK, dim=-1, descending=True, stable=True)
        return count, order.to(torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        return mask_BN[b, kv_idx]

    return BlockMask.from_kv_blocks(
        *ordered(partial_BQK),
        *ordered(full_BQK),
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(N, N),
    )


def tisa_flex_attention(
    q_BHNh: Tensor,
    k_BHNh: Tensor,
    v_BHNh: Tensor,
    values_HM: Tensor,
    mask_BN: Tensor | None,
    block_mask=None,
    dense_bias_HNN: Tensor | None = None,
) -> Tensor:
    """softmax(Q K^T / sqrt(h) + F_P + key_padding) V through FlexAttention: F_P in the
    score_mod, the key padding in a block mask (`block_mask`, else built from `mask_BN`; no mask
    when `mask_BN` is None, i.e. the batch is unpadded). F_P is read from the table `values_HM`,
    or from `dense_bias_HNN` when given (`tisa.flex_bias: dense`; made from the same table)."""
    from torch.nn.attention.flex_attention import flex_attention

    if dense_bias_HNN is not None:
        score_mod, kernel_options = tisa_dense_score_mod(dense_bias_HNN), DENSE_FLEX_KERNEL_OPTIONS
    else:
        score_mod, kernel_options = tisa_score_mod(values_HM.to(q_BHNh.dtype)), None
    if block_mask is None and mask_BN is not None:
        block_mask = key_padding_block_mask(mask_BN)
    if torch.compiler.is_compiling() or not q_BHNh.is_cuda:
        # Inside a compiled encoder (EngineConfig.compile) Dynamo captures flex_attention itself;
        # on CPU (no grad) eager flex is the tested reference.
        attend = flex_attention
    else:
        attend = _compiled_flex_attention()
    return attend(
        q_BHNh,
        k_BHNh,
        v_BHNh,
        score_mod=score_mod,
        block_mask=block_mask,
        kernel_options=kernel_options,
    )


class TISAState(FamilyState):
    """The scorers, run once per forward: f at the 2N-1 offsets for every head of every scorer.

    Extras for the kernels: `tisa_values` (P, H, 2N-1), P = 1 (`shared`) or L (`per_layer`).
    With the shared scope and the sdpa backend it also builds the bias every layer uses,
    `tisa_bias` = F_P + key padding, (B, H, N, N), or F_P alone, (1, H, N, N), for an unpadded
    batch; with the flex backend and a padded batch, the key-padding block mask every layer
    uses, `tisa_block_mask`; with the flex backend, the shared scope and `tisa.flex_bias:
    dense`, F_P as an fp32 (H, N, N) tensor, `tisa_flex_bias`. Each is built once per forward,
    here rather than lazily by the first kernel: a kernel-side cache would make activation
    checkpointing recompute a different graph than the original forward.
    """

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        num_scorers = cfg.num_layer_applications if cfg.tisa.scope == "per_layer" else 1
        self.scorers = nn.ModuleList(
            PositionScorer(cfg.tisa.num_kernels, cfg.num_attention_heads, cfg.tisa.init)
            for _ in range(num_scorers)
        )

    def forward(
        self, x0_BND: Tensor, mask_BN: Tensor, padded: bool = True
    ) -> tuple[dict[str, Any], AuxLosses]:
        N = x0_BND.size(1)
        values_PHM = torch.stack([scorer.values(N) for scorer in self.scorers])
        extras: dict[str, Any] = {"tisa_values": values_PHM}
        dropout_active = self.training and self.cfg.attention_probs_dropout_prob > 0
        backend = select_backend(self.cfg, x0_BND.device, dropout_active, N)
        if backend == "flex" and padded:
            extras["tisa_block_mask"] = key_padding_block_mask(mask_BN)
        dense = self.cfg.tisa.flex_bias == "dense" and self.cfg.tisa.scope == "shared"
        if backend == "flex" and dense:  # the fp32 (H, N, N) F_P every layer reads
            extras["tisa_flex_bias"] = flex_dense_bias(values_PHM[0])
        if self.cfg.tisa.scope == "shared" and backend in ("sdpa", "split"):
            # The dtype the kernels' queries will have (autocast's, else the weights').
            dtype = compute_dtype(x0_BND)
            extras["tisa_bias"] = sdpa_bias(values_PHM[0], mask_BN if padded else None, dtype)
        return extras, {}


def sdpa_bias(values_HM: Tensor, mask_BN: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The SDPA `attn_mask`: F_P + key padding, (B, H, N, N); F_P alone, (1, H, N, N), when
    `mask_BN` is None (an unpadded batch: B times less memory)."""
    bias_HNN = toeplitz_bias(values_HM).to(dtype)
    if mask_BN is None:
        return bias_HNN[None]
    return bias_HNN + key_padding_bias(mask_BN, dtype)  # (H, N, N) + (B, 1, 1, N)


class TISAKernel(ScoreKernel):
    """softmax(Q K^T / sqrt(h) + F_P + key_padding) V, with F_P from `TISAState`'s values."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.per_layer = cfg.tisa.scope == "per_layer"
        self.dropout_p = cfg.attention_probs_dropout_prob
        self._warned_dropout = False

    def forward(
        self, q_BHNh: Tensor, k_BHNh: Tensor, v_BHNh: Tensor, ctx: LayerContext
    ) -> tuple[Tensor, AuxLosses]:
        values_PHM = ctx.extras["tisa_values"]
        scorer = ctx.layer_index if self.per_layer else 0
        assert scorer < values_PHM.size(0), "per_layer TISA needs one scorer per application"
        dropout_p = self.dropout_p if self.training else 0.0
        backend = select_backend(self.cfg, q_BHNh.device, dropout_p > 0, q_BHNh.size(-2))
        chosen = self.cfg.tisa.backend
        if chosen in ("flex", "split") and dropout_p > 0 and not self._warned_dropout:
            warnings.warn(
                f"tisa.backend={chosen!r} with attention_probs_dropout_prob > 0 in training: "
                "it has no attention dropout, falling back to sdpa",
                stacklevel=2,
            )
            self._warned_dropout = True

        mask_BN = ctx.mask_BN if ctx.padded else None
        if backend == "flex":
            block_mask = ctx.extras.get("tisa_block_mask")  # built once per forward by the state
            dense = ctx.extras.get("tisa_flex_bias")  # shared scope: built once by the state
            if dense is None and self.cfg.tisa.flex_bias == "dense":  # per layer: its own scorer
                dense = flex_dense_bias(values_PHM[scorer])
            out = tisa_flex_attention(
                q_BHNh, k_BHNh, v_BHNh, values_PHM[scorer], mask_BN, block_mask, dense
            )
            return out, {}

        bias = ctx.extras.get("tisa_bias")  # shared scope: built once per forward by the state
        if bias is None or bias.dtype != q_BHNh.dtype:
            bias = sdpa_bias(values_PHM[scorer], mask_BN, q_BHNh.dtype)
        if backend == "split":  # the bias without a gradient; f's gradient by its own kernel
            out = split_attention(q_BHNh, k_BHNh, v_BHNh, values_PHM[scorer], bias, mask_BN)
            return out, {}
        out = F.scaled_dot_product_attention(
            q_BHNh, k_BHNh, v_BHNh, attn_mask=bias, dropout_p=dropout_p
        )
        return out, {}


@torch.no_grad()
def tisa_curves(encoder: nn.Module, max_offset: int = 64) -> tuple[Tensor, Tensor]:
    """(offsets (K,), f values (num_scorers, H, K)) with k = j - i from -max_offset to
    max_offset, for an encoder of this family (its ``family_state`` is a `TISAState`)."""
    offsets = torch.arange(-max_offset, max_offset + 1, dtype=torch.float32)
    curves = torch.stack([scorer.score(offsets) for scorer in encoder.family_state.scorers])
    return offsets, curves.float()


def tisa_figures(encoder: nn.Module) -> dict[str, Any]:
    """TensorBoard's ``diagnostics/tisa_curves``: f(k) of every head, one panel per scorer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    offsets, curves = tisa_curves(encoder)
    scorers, heads = curves.shape[0], curves.shape[1]
    fig, axes = plt.subplots(1, scorers, figsize=(4 * scorers, 3), squeeze=False)
    for s in range(scorers):
        ax = axes[0][s]
        for h in range(heads):
            ax.plot(offsets.numpy(), curves[s, h].numpy(), label=f"head {h}")
        ax.set_title(f"TISA f(k), scorer {s}")
        ax.set_xlabel("k = j - i")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    return {"diagnostics/tisa_curves": fig}


FAMILY = AttentionFamily(
    name="tisa",
    description="translation-invariant self-attention: softmax with a learned f(j - i) per head",
    kernel=TISAKernel,
    state=TISAState,
    mixing_flops=softmax_mixing_flops,
    figures=tisa_figures,
    hf_export=HFExport(code=family_code(__file__, "tisa_hf.py")),
    options=TISAConfig,
    # Compiled on a GPU it was measured faster: docs/benchmarks.md#compiled-against-eager.
    compile_auto=True,
)

__all__ = [
    "FAMILY",
    "PositionScorer",
    "TISAConfig",
    "TISAKernel",
    "TISAState",
    "flex_dense_bias",
    "key_padding_block_mask",
    "sdpa_bias",
    "select_backend",
    "tisa_curves",
    "tisa_dense_score_mod",
    "tisa_figures",
    "tisa_flex_attention",
    "tisa_score_mod",
    "toeplitz_bias",
]
