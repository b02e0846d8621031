"""The `AttentionFamily.hf_export` hook: how a family's models are exported to Hugging Face
`transformers` (``python -m pretrain.export --format hf``, `model.hub.hf_export`).

A family gives:

* ``code``: its HF-side source file, next to its own file (``model/attention/<name>_hf.py``),
  importing `torch` (and `transformers`) only. The export copies it as ``albatross_family.py``
  beside the generic remote code (`model/hub/hf_remote/`), which takes the family's modules from its
  ``PARTS`` dict: ``kernel`` (the mixing step of a standard layer, ``(q, k, v, ctx) -> (out,
  aux)`` on (B, H, N, h) tensors), ``state`` (run once per forward, ``(x0, mask) -> (extras,
  aux)``), ``layer`` and ``embeddings`` (a family with its own). Its modules carry the names of
  the family's modules here, so the exported weights are the release's tensors under their own
  keys, with each parameterised tensor (an orthogonal map) stored as its value.
* ``native`` (optional): a map to a model `transformers` has natively (softmax -> ALBERT), used
  when it can represent the config; it raises `NotNative` (the reason) when it cannot, and the
  remote code is used instead.

A family without the hook cannot be exported to `transformers`: the export says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from model.config import EncoderConfig


class NotNative(ValueError):
    """A config that the family's native `transformers` model cannot represent (the reason)."""


@dataclass
class NativeModel:
    """A native `transformers` checkpoint: config.json's contents (with ``model_type`` and
    ``architectures``) and the tensors under `transformers`' names."""

    config: dict[str, Any]
    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)


NativeFn = Callable[["EncoderConfig", dict[str, Any], dict[str, "torch.Tensor"]], NativeModel]
"""(encoder config, head config, the release's tensors with parameterised ones as their values)
-> the native checkpoint; raises `NotNative` for a config it cannot represent."""


@dataclass(frozen=True)
class HFExport:
    code: Path
    """The family's HF-side source (torch and transformers imports only), defining ``PARTS``."""
    native: NativeFn | None = None
    """Optional: the family's native `transformers` model (no remote code needed)."""


def family_code(family_file: str, name: str) -> Path:
    """``<name>`` next to a family's file (its ``__file__``)."""
    return Path(family_file).with_name(name)


__all__ = ["HFExport", "NativeFn", "NativeModel", "NotNative", "family_code"]
