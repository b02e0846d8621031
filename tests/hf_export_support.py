"""Small releases of every attention family with non-trivial parameters, for the Hugging Face
export tests (tests/test_hf_export*.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from test_toy_family import MeanKernel

from model import register_attention
from model.attention import ATTENTION_REGISTRY, AttentionFamily
from model.attention.hf_export import HFExport
from model.config import EncoderConfig
from model.heads import build_model
from model.hub.release import save_release
from model.orthogonal import orthogonal_modules

ATOL = 1e-5
TESTS = Path(__file__).resolve().parent

# Families registered from outside the package (test_toy_family.py's uniform attention): one
# that brings its HF export (its HF-side file, tests/toy_family_hf.py), one that does not.
if "toy-mean-hf" not in ATTENTION_REGISTRY:
    register_attention(
        AttentionFamily(
            name="toy-mean-hf",
            description="uniform attention, with its HF export",
            kernel=MeanKernel,
            hf_export=HFExport(code=TESTS / "toy_family_hf.py"),
        )
    )
if "toy-no-hf" not in ATTENTION_REGISTRY:
    register_attention(
        AttentionFamily(name="toy-no-hf", description="uniform attention", kernel=MeanKernel)
    )

BASE = dict(
    vocab_size=300,
    embedding_size=16,
    hidden_size=32,
    num_hidden_layers=4,
    num_hidden_groups=2,
    inner_group_num=1,
    num_attention_heads=4,
    intermediate_size=37,
    max_position_embeddings=64,
)

FAMILIES: dict[str, dict[str, Any]] = {
    # a native ALBERT: 2 groups x 2 layers each, so HF's per-layer hidden states are exercised
    "softmax": {"attention": "softmax", "inner_group_num": 2},
    "tisa": {"attention": "tisa", "tisa": {"scope": "per_layer", "num_kernels": 3}},
    "kernel": {
        "attention": "kernel",
        "kernel": {"feature_map": "aoglu", "num_stacked": 2, "orthogonality_penalty": 0.1},
    },
    "transject": {"attention": "transject", "num_hidden_groups": 4},
    # softmax that ALBERT cannot represent: the family's remote code instead
    "softmax_pre_ln": {
        "attention": "softmax",
        "residual": "pre_ln",
        "orthogonal": True,
        "position_embedding": "none",
    },
    # a family registered from outside the package, with its own HF export
    "toy": {"attention": "toy-mean-hf"},
}
"""Export name -> encoder overrides."""


def perturb_(model: torch.nn.Module, seed: int, scale: float = 0.2) -> torch.nn.Module:
    """Adds N(0, scale^2) to every free parameter: LayerNorms leave 1, biases 0, TISA
    amplitudes and TransJect's residual gates leave 0, orthogonal maps leave their init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model.eval()


def build(name: str, head: dict[str, Any] | None = None, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = EncoderConfig.from_dict({**BASE, **FAMILIES[name]})
    return perturb_(build_model(cfg, head or {"type": "pretraining"}), seed + 1)


def make_release(name: str, root: Path, tokenizer: Path | None, **kw) -> Path:
    model = build(name, **kw)
    return save_release(root / f"release_{name}", model, tokenizer_file=tokenizer)


def make_inputs(vocab_size: int = 300, seed: int = 1) -> dict[str, torch.Tensor]:
    """A padded batch (rows of 11, 7 and 4 real tokens, [CLS] first) with both token types."""
    g = torch.Generator().manual_seed(seed)
    B, N = 3, 11
    lengths = torch.tensor([11, 7, 4])
    mask = (torch.arange(N)[None, :] < lengths[:, None]).long()
    ids = torch.randint(5, vocab_size, (B, N), generator=g) * mask
    ids[:, 0] = 2
    types = (torch.arange(N)[None, :] >= (lengths[:, None] // 2)).long() * mask
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def save_inputs(path: Path) -> Path:
    save_file(make_inputs(), str(path))
    return path


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    return (a.double() - b.double()).abs().max().item()


def assert_non_trivial(model: torch.nn.Module) -> None:
    """TISA amplitudes non-zero, orthogonal maps far from the identity, residual gates set."""
    for name, p in model.named_parameters():
        if name.endswith(".a"):  # TISA amplitudes
            assert p.abs().min() > 1e-3, name
        if "residual_gates" in name:
            assert p.abs().min() > 1e-3, name
    for qual, module, tensor in orthogonal_modules(model):
        W = getattr(module, tensor)
        if W.shape[-1] == W.shape[-2]:
            eye = torch.eye(W.shape[-1])
            assert (W - eye).abs().max() > 0.1, f"{qual}.{tensor} is near the identity"
