"""Import a local Hugging Face `transformers` ALBERT checkpoint into our model; write a release dir.
Also reads back this project's own Hugging Face exports (`model.hub.hf_export`, any family), and
exports a softmax model as a native ALBERT (`model.hub.albert_names.albert_export`, the name
table read backwards).

    python -m model.hub.hf_import --hf-dir albert-base-v2/ --out releases/albert-base-v2-tisa \\
        --attention tisa

The HF dir holds `config.json` and `model.safetensors` or `pytorch_model.bin` (or their sharded
`*.index.json` forms) of an `AlbertModel`, `AlbertForPreTraining`, `AlbertForMaskedLM` or
`AlbertForSequenceClassification`; keys may carry the `albert.` prefix or not.

Every HF name is mapped to ours by one explicit table (`hf_name_map`); nothing else renames
tensors. The import fails, listing them, when one of our encoder tensors has no HF source, and
warns about HF tensors it did not use (except known ignorable ones: position-id buffers and the
MLM decoder, which is tied to the token embedding in both models).

`attention="tisa"` adds TISA (docs/methods.md, TISA) with `init="zero_amplitude"`: its scorer is
newly initialised with amplitude 0, so the imported model's outputs are unchanged at step 0
(the TISA paper's GLUE protocol on albert-base-v2). Everything else is copied.

Hidden states: HF `transformers` 5.x returns one hidden state per ALBERT layer call
(1 + num_hidden_layers * inner_group_num), 4.x one per group application; ours returns one per
group application (1 + num_hidden_layers). They coincide when inner_group_num == 1.

This module needs no `transformers` install: it reads the checkpoint files directly.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from model.config import EncoderConfig, config_from_dict
from model.heads import build_model
from model.hub.albert_names import (
    HF_ARCHITECTURES,
    HF_CONFIG_FIELDS,
    HF_CONFIG_FILE,
    HF_TOKENIZER_FILE,
    HF_WEIGHT_FILES,
    IGNORABLE_HF_TENSORS,
    IMPORTABLE_ATTENTION,
    TIED_DECODER_WEIGHT,
    hf_group_schedule,
    hf_hidden_act,
    hf_name_map,
    normalise_hf_key,
)
from model.hub.release import save_release

log = logging.getLogger(__name__)


def encoder_config_from_hf(hf_config: dict[str, Any], **overrides: Any) -> EncoderConfig:
    """Our `EncoderConfig` for an HF ALBERT `config.json` dict, plus field overrides.

    Raises ValueError for what we cannot represent: a non-ALBERT model, relative position
    embeddings, an unsupported activation, a layer-sharing schedule that differs from ours.
    """
    model_type = hf_config.get("model_type", "albert")
    if model_type != "albert":
        raise ValueError(f"not an ALBERT config: model_type={model_type!r}")
    position_type = hf_config.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ValueError(
            f"HF position_embedding_type={position_type!r} is not supported; only 'absolute' "
            "(learned absolute positions) can be imported"
        )
    data: dict[str, Any] = {
        ours: hf_config[theirs] for theirs, ours in HF_CONFIG_FIELDS.items() if theirs in hf_config
    }
    if "hidden_act" in hf_config:
        data["hidden_act"] = hf_hidden_act(hf_config["hidden_act"])
    if data.get("pad_token_id", 0) is None:
        data["pad_token_id"] = 0
    data["position_embedding"] = "absolute"
    data["residual"] = "post_ln"
    data.update(overrides)
    cfg = config_from_dict(EncoderConfig, data)
    hf_schedule = hf_group_schedule(cfg.num_hidden_layers, cfg.num_hidden_groups)
    if hf_schedule != cfg.group_schedule():
        raise ValueError(
            f"num_hidden_layers={cfg.num_hidden_layers}, num_hidden_groups={cfg.num_hidden_groups}: "
            f"HF runs groups {hf_schedule}, this model would run {cfg.group_schedule()}"
        )
    return cfg


def hf_num_labels(hf_config: dict[str, Any]) -> int:
    """`num_labels` as `transformers` derives it: explicit, else len(id2label), else 2."""
    if "num_labels" in hf_config:
        return int(hf_config["num_labels"])
    if hf_config.get("id2label"):
        return len(hf_config["id2label"])
    return 2


def head_from_hf(hf_config: dict[str, Any], hf_state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Our head config for an HF checkpoint: from `architectures`, else from its tensors."""
    architectures = hf_config.get("architectures") or []
    if architectures:
        arch = architectures[0]
        if arch not in HF_ARCHITECTURES:
            raise ValueError(
                f"HF architecture {arch!r} is not supported; supported: {sorted(HF_ARCHITECTURES)}"
            )
        head_type = HF_ARCHITECTURES[arch]
    else:
        head_type = "sequence_classification" if "classifier.weight" in hf_state else "pretraining"
    if head_type == "sequence_classification":
        return {
            "type": head_type,
            "num_labels": hf_num_labels(hf_config),
            "pooling": "cls",
            "classifier_dropout": hf_config.get("classifier_dropout_prob"),
        }
    return {"type": head_type}


# ----------------------------------------------------------------------------- files


def read_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    hf = Path(hf_dir)
    if not hf.is_dir():
        raise FileNotFoundError(f"HF checkpoint dir {hf} does not exist")
    path = hf / HF_CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a transformers checkpoint dir")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return config


def _load_weight_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return load_file(str(path), device="cpu")
    return torch.load(path, map_location="cpu", weights_only=True)


def load_hf_state_dict(hf_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under their HF names (prefix and legacy names normalised)."""
    hf = Path(hf_dir)
    found = next((hf / name for name in HF_WEIGHT_FILES if (hf / name).is_file()), None)
    if found is None:
        raise FileNotFoundError(f"no weights in {hf}: expected one of {list(HF_WEIGHT_FILES)}")
    if found.name.endswith(".index.json"):
        weight_map = json.loads(found.read_text())["weight_map"]
        raw: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            if not (hf / shard).is_file():
                raise FileNotFoundError(f"{found} names shard {shard}, which is missing")
            raw.update(_load_weight_file(hf / shard))
    else:
        raw = _load_weight_file(found)
    state: dict[str, torch.Tensor] = {}
    for key, tensor in raw.items():
        name = normalise_hf_key(key)
        if name in state:
            raise ValueError(f"{found}: {key!r} and another tensor both map to {name!r}")
        state[name] = tensor
    return state


# ----------------------------------------------------------------------------- weights


@dataclass
class ImportReport:
    loaded: list[str] = field(default_factory=list)
    """Our tensors copied from the checkpoint."""
    initialised: list[str] = field(default_factory=list)
    """Our tensors left at their initialisation (new attention parameters, absent heads)."""
    unused: list[str] = field(default_factory=list)
    """HF tensors that were not used and are not known to be ignorable."""


def load_hf_weights(
    model: torch.nn.Module, hf_state: dict[str, torch.Tensor], allow_new: bool = False
) -> ImportReport:
    """Copies `hf_state` into `model` (in place) through `hf_name_map`.

    Every encoder tensor of the table must be found (else ValueError listing the missing ones);
    absent head tensors are left initialised. Tensors of ours outside the table (the attention
    family's new parameters, e.g. TISA's scorer) are an error unless `allow_new`.
    """
    cfg: EncoderConfig = model.config
    names = hf_name_map(cfg, model.head_type)
    own = model.state_dict()
    not_ours = sorted(set(names) - own.keys())
    assert not not_ours, f"name table names tensors the model does not have: {not_ours}"

    new = sorted(set(own) - names.keys())
    if new and not allow_new:
        raise ValueError(f"the model has tensors with no HF counterpart: {new}")
    report = ImportReport(initialised=new)

    used: set[str] = set()
    missing: list[str] = []
    updates: dict[str, torch.Tensor] = {}
    for ours, candidates in names.items():
        source = next((c for c in candidates if c in hf_state), None)
        if source is None:
            if ours.startswith("encoder."):
                missing.append(f"{ours} (HF {' or '.join(candidates)})")
            else:
                report.initialised.append(ours)
            continue
        tensor = hf_state[source]
        if tuple(tensor.shape) != tuple(own[ours].shape):
            raise ValueError(
                f"HF {source} has shape {tuple(tensor.shape)}, {ours} needs {tuple(own[ours].shape)}"
            )
        updates[ours] = tensor.to(own[ours].dtype)
        used.add(source)
        report.loaded.append(ours)
    if missing:
        raise ValueError(f"the HF checkpoint lacks {len(missing)} encoder tensor(s): {missing}")

    _check_tied_decoder(hf_state, updates, used)
    own.update(updates)
    model.load_state_dict(own, strict=True)

    report.unused = sorted(set(hf_state) - used - IGNORABLE_HF_TENSORS)
    return report


def _check_tied_decoder(
    hf_state: dict[str, torch.Tensor], updates: dict[str, torch.Tensor], used: set[str]
) -> None:
    """Our MLM decoder is the token embedding: an HF decoder weight must equal it."""
    word = updates["encoder.embeddings.word_embeddings.weight"]
    decoder = hf_state.get(TIED_DECODER_WEIGHT)
    if decoder is not None and not torch.equal(decoder.to(word.dtype), word):
        raise ValueError(
            f"HF {TIED_DECODER_WEIGHT} differs from the word embedding: an untied MLM decoder "
            "cannot be represented (our decoder is tied to the token embedding)"
        )
    bias, decoder_bias = hf_state.get("predictions.bias"), hf_state.get("predictions.decoder.bias")
    if (
        "predictions.bias" in used
        and decoder_bias is not None
        and not torch.equal(decoder_bias.to(bias.dtype), bias)
    ):
        log.warning(
            "HF predictions.decoder.bias differs from predictions.bias; using predictions.bias "
            "(transformers ties the former to the latter when it loads)"
        )


# ----------------------------------------------------------------------------- import


def _encoder_overrides(attention: str, tisa_overrides: dict[str, Any] | None) -> dict[str, Any]:
    if attention not in IMPORTABLE_ATTENTION:
        raise ValueError(
            f"attention={attention!r} cannot be imported from ALBERT; choose one of "
            f"{list(IMPORTABLE_ATTENTION)}"
        )
    if attention == "softmax":
        if tisa_overrides:
            raise ValueError("tisa_overrides given with attention='softmax'")
        return {}
    tisa = {"init": "zero_amplitude", **(tisa_overrides or {})}
    if tisa["init"] != "zero_amplitude":
        log.warning(
            "tisa.init=%r: the imported model's outputs will differ from the HF model's",
            tisa["init"],
        )
    return {"attention": "tisa", "tisa": tisa}


def _import(
    hf_dir: str | os.PathLike, attention: str, tisa_overrides: dict[str, Any] | None
) -> tuple[torch.nn.Module, ImportReport, dict[str, Any]]:
    hf_config = read_hf_config(hf_dir)
    from model.hub.hf_export import EXPORT_MODEL_TYPE, import_export

    if hf_config.get("model_type") == EXPORT_MODEL_TYPE:  # our own export, any family
        if attention != "softmax" or tisa_overrides:
            raise ValueError(
                f"{hf_dir} is an albatross export of attention {hf_config.get('attention')!r}: "
                "its attention is fixed (drop the attention switch)"
            )
        model, exported = import_export(hf_dir)
        report = ImportReport(exported.loaded, exported.initialised, exported.unused)
        return model, report, hf_config
    cfg = encoder_config_from_hf(hf_config, **_encoder_overrides(attention, tisa_overrides))
    hf_state = load_hf_state_dict(hf_dir)
    head = head_from_hf(hf_config, hf_state)
    model = build_model(cfg, head)
    report = load_hf_weights(model, hf_state, allow_new=attention != "softmax")
    if report.initialised:
        log.info("newly initialised (no HF counterpart): %s", report.initialised)
    if report.unused:
        log.warning("HF tensors not used by the import: %s", report.unused)
    return model.eval(), report, hf_config


def import_hf_albert(
    hf_dir: str | os.PathLike,
    attention: str = "softmax",
    tisa_overrides: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """Builds our model from a local HF ALBERT checkpoint dir (in eval mode).

    Head: `pretraining` for AlbertModel / AlbertForPreTraining / AlbertForMaskedLM (MLM and SOP
    weights loaded where present), `sequence_classification` (cls pooling, num_labels from the
    config) for AlbertForSequenceClassification. `attention="tisa"` adds TISA at zero amplitude
    (`tisa_overrides`, e.g. {"scope": "per_layer"}, update the TISA config).
    """
    model, _, _ = _import(hf_dir, attention, tisa_overrides)
    return model


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m model.hub.hf_import",
        description="Import a local HF transformers ALBERT checkpoint into a release dir.",
    )
    p.add_argument("--hf-dir", required=True, help="dir with config.json + model weights")
    p.add_argument("--out", required=True, help="release dir to write")
    p.add_argument("--attention", choices=IMPORTABLE_ATTENTION, default="softmax")
    p.add_argument(
        "--tisa-scope", choices=("shared", "per_layer"), help="tisa.scope (with --attention tisa)"
    )
    p.add_argument("--tisa-num-kernels", type=int, help="tisa.num_kernels (with --attention tisa)")
    p.add_argument(
        "--tokenizer", help="tokenizer.json for the release (default: the HF dir's, if any)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing release dir")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    tisa = {
        key: value
        for key, value in (("scope", args.tisa_scope), ("num_kernels", args.tisa_num_kernels))
        if value is not None
    }
    try:
        if tisa and args.attention != "tisa":
            raise ValueError("--tisa-* options need --attention tisa")
        model, report, hf_config = _import(args.hf_dir, args.attention, tisa or None)
        tokenizer = args.tokenizer
        if tokenizer is None and (Path(args.hf_dir) / HF_TOKENIZER_FILE).is_file():
            tokenizer = Path(args.hf_dir) / HF_TOKENIZER_FILE
        if tokenizer is None:
            log.warning("no tokenizer.json in %s: the release has no tokenizer", args.hf_dir)
        extra = {
            "hf_import": {
                "hf_dir": str(Path(args.hf_dir).resolve()),
                "architectures": hf_config.get("architectures"),
                "transformers_version": hf_config.get("transformers_version"),
                "initialised": report.initialised,
                "unused": report.unused,
            }
        }
        out = save_release(args.out, model, tokenizer, extra=extra, overwrite=args.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log.info("wrote %s (%s head, %s attention)", out, model.head_type, model.config.attention)
    return 0


if __name__ == "__main__":
    sys.exit(main())
