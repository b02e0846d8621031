"""Continued pretraining: start from a release or a local HF ALBERT checkpoint instead of random
weights (``model.init_from``, ``python -m pretrain --init DIR``).

    model:
      init_from: albert-base-v2/        # a release dir, a local HF ALBERT dir (config.json,
                                        # model.safetensors or pytorch_model.bin), or this
                                        # project's HF export of any family (a Hub download)
      attention: tisa                   # optional: switch the family where weights carry over

The architecture comes from the checkpoint. The model section may add what does not change
the shapes of the checkpoint's tensors: the attention family and its settings, dropout,
``position_embedding``, ``orthogonal``, the residual scheme. An architecture key (sizes,
layers, vocabulary, ...) that differs from the checkpoint's is an error naming it.

Switching the family: softmax -> TISA starts TISA at zero amplitude (``tisa.init``
defaults to ``zero_amplitude``), so step 0 computes exactly the checkpoint's outputs; kernel
attention keeps the Q/K/V/O projections and adds its feature maps; TransJect replaces the layer
and the embeddings, so most of the checkpoint is not used. The start-up line names every tensor
that is new (initialised) and every checkpoint tensor left unused.

The shards' tokenizer must be the checkpoint's: the same vocabulary size and padding id, else a
clear error at start-up naming both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.config import SIZE_FIELDS, EncoderConfig
from model.heads import EncoderForPretraining
from model.hub.release import CONFIG_FILE, is_release, read_release_config

INIT_KEY = "init_from"
"""The model-section key naming the checkpoint to start from."""

ARCHITECTURE_KEYS = (*SIZE_FIELDS, "hidden_act", "layer_norm_eps", "pad_token_id")
"""Encoder keys the checkpoint fixes (the shapes and meaning of its tensors)."""


@dataclass
class InitReport:
    """What continued pretraining took from its checkpoint."""

    source: str
    kind: str
    """``"release"``, ``"hf"`` (an HF ALBERT checkpoint) or ``"export"`` (this project's HF
    export with remote code, ``model_type: albatross``)."""
    loaded: list[str] = field(default_factory=list)
    initialised: list[str] = field(default_factory=list)
    """Our tensors the checkpoint has no counterpart for (new, freshly initialised)."""
    unused: list[str] = field(default_factory=list)
    """Checkpoint tensors that found no place in the model."""

    def summary(self) -> str:
        line = f"initialised from {self.source} ({self.kind}): {len(self.loaded)} tensors loaded"
        if self.initialised:
            line += f"; new (initialised): {', '.join(self.initialised)}"
        if self.unused:
            line += f"; not used: {', '.join(self.unused)}"
        return line


def checkpoint_encoder(init: Path) -> tuple[dict[str, Any], str]:
    """The encoder config of the checkpoint at ``init`` (as a dict) and its kind."""
    if not init.is_dir():
        raise ValueError(f"model.{INIT_KEY}={str(init)!r}: no such directory")
    if is_release(init):
        return dict(read_release_config(init)["encoder"]), "release"
    from model.hub.hf_export import export_encoder_config, is_export

    if is_export(init):
        return export_encoder_config(init).to_dict(), "export"
    if not (init / CONFIG_FILE).is_file():
        raise ValueError(
            f"model.{INIT_KEY}={str(init)!r} is neither a release nor an HF ALBERT checkpoint "
            f"(no {CONFIG_FILE})"
        )
    from model.hub.hf_import import encoder_config_from_hf, read_hf_config

    return encoder_config_from_hf(read_hf_config(init)).to_dict(), "hf"


def encoder_config(
    model_section: dict[str, Any], vocab_size: int, pad_token_id: int
) -> EncoderConfig:
    """The encoder config of a continued run: the checkpoint's architecture, the model
    section's family and training settings on top. ValueError for a conflicting architecture
    key and for a tokenizer that is not the checkpoint's."""
    section = dict(model_section)
    init = Path(section.pop(INIT_KEY))
    base, _ = checkpoint_encoder(init)
    if section.get("preset") is None:
        section.pop("preset", None)  # preset: null, no preset
    else:
        preset = EncoderConfig.preset(section.pop("preset")).to_dict()
        section = {**{k: v for k, v in preset.items() if k in ARCHITECTURE_KEYS}, **section}
    conflicts = [
        f"model.{key}={section[key]!r} (the checkpoint has {base[key]!r})"
        for key in ARCHITECTURE_KEYS
        if key in section and section[key] != base.get(key)
    ]
    if conflicts:
        raise ValueError(
            f"model.{INIT_KEY}={str(init)!r} fixes the architecture; the model section "
            f"conflicts with it: {'; '.join(conflicts)}. Drop those keys (and a preset) "
            "from the model section"
        )
    for key, ours, what in (
        ("vocab_size", vocab_size, "tokens"),
        ("pad_token_id", pad_token_id, "as its padding id"),
    ):
        if base[key] != ours:
            raise ValueError(
                f"the tokenizer of data.shards has {ours} {what}, the checkpoint "
                f"{str(init)!r} {base[key]} ({key}): make the shards with the checkpoint's "
                "own tokenizer (python -m data_prep shards --tokenizer <its tokenizer.json>)"
            )
    merged = {**base, **section}
    if merged.get("attention") == "tisa" and base.get("attention") != "tisa":
        tisa = dict(merged.get("tisa") or {})
        tisa.setdefault("init", "zero_amplitude")  # step 0 computes the checkpoint's outputs
        merged["tisa"] = tisa
    return EncoderConfig.from_dict(merged)


def load_init(model: EncoderForPretraining, model_section: dict[str, Any]) -> InitReport:
    """Copies the checkpoint's tensors into ``model`` (built from `encoder_config`), in place;
    the rest of ``model`` keeps its fresh initialisation."""
    init = Path(model_section[INIT_KEY])
    _, kind = checkpoint_encoder(init)
    report = InitReport(source=str(init), kind=kind)
    if kind == "hf":
        from model.hub.hf_import import load_hf_state_dict, load_hf_weights

        imported = load_hf_weights(model, load_hf_state_dict(init), allow_new=True)
        report.loaded, report.unused = list(imported.loaded), list(imported.unused)
        report.initialised = list(imported.initialised)
        return report
    from model.hub.hf_export import load_release_or_export

    source = load_release_or_export(init).state_dict()  # its own head (a classifier's: no MLM)
    own = model.state_dict()
    shape_errors = [
        f"{name}: {tuple(t.shape)} in the checkpoint, {tuple(own[name].shape)} here"
        for name, t in source.items()
        if name in own and t.shape != own[name].shape
    ]
    if shape_errors:
        raise ValueError(f"{init}: tensors do not fit: {'; '.join(shape_errors[:5])}")
    updates = {name: t.to(own[name].dtype) for name, t in source.items() if name in own}
    own.update(updates)
    model.load_state_dict(own, strict=True)
    report.loaded = sorted(updates)
    report.initialised = sorted(set(own) - set(source))
    report.unused = sorted(set(source) - set(own))
    return report


__all__ = [
    "ARCHITECTURE_KEYS",
    "INIT_KEY",
    "InitReport",
    "checkpoint_encoder",
    "encoder_config",
    "load_init",
]
