"""Export a release to a directory that Hugging Face `transformers` loads, and import one back.

    from model.hub.hf_export import export_hf
    export_hf("releases/tisa-base", "hub/tisa-base", card=ModelCardInfo(...))

What the directory holds (`transformers` loads it without this project installed):

* ``config.json`` + ``model.safetensors`` (fp32):
  - a family whose ``AttentionFamily.hf_export`` hook has a ``native`` map that represents the
    model (softmax with ALBERT's layout -> ``model_type: albert``, ``AlbertForPreTraining`` or
    ``AlbertForSequenceClassification``) is a native `transformers` checkpoint: ``AutoModel``
    loads it without remote code;
  - otherwise ``model_type: albatross`` with ``auto_map`` naming the remote code written beside
    it (``configuration_albatross.py``, ``modeling_albatross.py`` from `model/hub/hf_remote/` and
    ``albatross_family.py``, the family's own HF-side file), loaded with
    ``trust_remote_code=True``; the weights are the release's tensors under their own names,
    each parameterised tensor (an orthogonal map) stored as its value;
* ``tokenizer.json`` (the release's, unchanged), ``tokenizer_config.json`` and
  ``special_tokens_map.json`` naming its special tokens, so that ``AutoTokenizer`` returns a
  fast tokenizer with [CLS], [SEP], [MASK], the padding and the unknown token set;
* ``README.md``, a model card in the Hub's format (YAML front matter, then the family, the
  sizes, the recipe, the data and the final validation metrics).

A family without the hook, a head with no `transformers` counterpart (the dual encoder) or a
directory that is not a release raise `ExportError` (a ValueError) naming the problem.

`import_export` reads such a directory back into this project's model (fine-tuning from an
export, `model.hub.hf_import` and GLUE's ``--init`` use it): the config carries the release's
encoder config, and each orthogonal map is given back its free parameters by inverting the
Cayley map (`cayley_inverse`), so the imported model computes the exported one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from albatross.files import staged_directory
from model.attention import ATTENTION_REGISTRY
from model.attention.hf_export import NativeModel, NotNative
from model.attention.registry import options_key
from model.config import EncoderConfig, config_to_dict
from model.heads import build_model
from model.hub.release import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    ReleaseError,
    is_release,
    load_release,
    read_release_config,
)
from model.orthogonal import cayley, orthogonal_cache, orthogonal_modules
from model.typed_config import config_from_dict, config_keys

log = logging.getLogger(__name__)

EXPORT_MODEL_TYPE = "albatross"
"""``model_type`` of an export that needs the remote code."""
REMOTE_CODE = Path(__file__).resolve().parent / "hf_remote"
REMOTE_FILES = ("configuration_albatross.py", "modeling_albatross.py")
FAMILY_FILE = "albatross_family.py"
"""The name the family's HF-side file gets in an export (the remote code imports it)."""
CARD_FILE = "README.md"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"

ARCHITECTURES = {
    "pretraining": "AlbatrossForPreTraining",
    "sequence_classification": "AlbatrossForSequenceClassification",
}
"""Our head -> the remote-code class the export's ``architectures`` names."""
AUTO_MAP = {
    "AutoConfig": "configuration_albatross.AlbatrossConfig",
    "AutoModel": "modeling_albatross.AlbatrossModel",
    "AutoModelForPreTraining": "modeling_albatross.AlbatrossForPreTraining",
    "AutoModelForMaskedLM": "modeling_albatross.AlbatrossForMaskedLM",
    "AutoModelForSequenceClassification": "modeling_albatross.AlbatrossForSequenceClassification",
}

SPECIAL_TOKEN_ROLES = {
    "pad_token": ("<pad>", "[PAD]"),
    "unk_token": ("<unk>", "[UNK]"),
    "cls_token": ("[CLS]", "<cls>"),
    "sep_token": ("[SEP]", "<sep>"),
    "mask_token": ("[MASK]", "<mask>"),
}
"""`transformers`' special-token roles and their spellings (as `data_prep.format`)."""

ORTHOGONAL_TOLERANCE = 1e-4
"""Largest |cayley(X) - W| accepted when an import gives a matrix back its free parameters."""


class ExportError(ValueError):
    """An export that cannot be made: the message names the release and the problem."""


@dataclass
class ModelCardInfo:
    """What the model card says beyond the model itself (all optional)."""

    source: str | None = None
    """Where the weights come from (a run directory and step, or a release)."""
    step: int | None = None
    tokens: int | None = None
    recipe: dict[str, Any] = field(default_factory=dict)
    """Training settings, shown as a table (e.g. optimizer.lr: 0.00176)."""
    data: dict[str, Any] = field(default_factory=dict)
    """Training data, shown as a table (e.g. shards, tokenizer)."""
    validation: dict[str, float] = field(default_factory=dict)
    """Final validation metrics (e.g. eval/loss/mlm: 6.1)."""
    validation_step: int | None = None


# ----------------------------------------------------------------------------- weights


def _plain_name(key: str) -> str:
    """``m.parametrizations.weight.original`` -> ``m.weight`` (other keys unchanged)."""
    if ".parametrizations." not in key:
        return key
    owner, rest = key.split(".parametrizations.", 1)
    return f"{owner}.{rest.split('.', 1)[0]}"


def materialised_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors, fp32, with each parameterised tensor (an orthogonal map) as its
    value under the plain name (``m.parametrizations.weight.original`` -> ``m.weight``)."""
    out: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    with torch.no_grad(), orthogonal_cache():
        for key, tensor in model.state_dict().items():
            if ".parametrizations." in key:
                owner, rest = key.split(".parametrizations.", 1)
                name = rest.split(".", 1)[0]
                plain = f"{owner}.{name}" if owner else name
                if plain not in out:
                    out[plain] = getattr(modules[owner], name).detach()
                continue
            out[key] = tensor.detach()
    return {
        k: v.float().contiguous().clone() if v.is_floating_point() else v for k, v in out.items()
    }


def cayley_inverse(Q: torch.Tensor) -> torch.Tensor:
    """Free parameters X with `model.orthogonal.cayley(X) == Q` (up to rounding), for Q (..., n, k)
    with orthonormal columns (n >= k) or rows (n < k) in the image of the Cayley map.

    The map embeds the lower triangle of X in a skew matrix A (X's columns, then zeros) and
    returns the first k columns of (I - A/2)^-1 (I + A/2). Writing A = [[A11, -A21^T], [A21, 0]]
    and Q = [Qa; Qb] (k and n - k rows), (I - A/2) Q = (I + A/2)[:, :k] gives
    A21 = 2 Qb (Qa + I)^-1 and A11 = (2 (Qa - I) + A21^T Qb) (Qa + I)^-1; X is A's strict
    lower triangle in its first k columns. Computed in fp64.
    """
    n, k = Q.shape[-2], Q.shape[-1]
    transposed = n < k
    if transposed:
        Q = Q.mT
        n, k = k, n
    Q = Q.double()
    eye = torch.eye(k, dtype=Q.dtype, device=Q.device)
    Qa, Qb = Q[..., :k, :], Q[..., k:, :]
    P_inv = torch.linalg.inv(Qa + eye)
    A21 = 2 * Qb @ P_inv
    A11 = (2 * (Qa - eye) + A21.mT @ Qb) @ P_inv
    X = torch.cat([A11.tril(-1), A21], dim=-2)
    return (X.mT if transposed else X).float()


# ----------------------------------------------------------------------------- export


def _special_tokens(tokenizer_file: Path) -> dict[str, str]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    found = {}
    for role, spellings in SPECIAL_TOKEN_ROLES.items():
        present = [s for s in spellings if tok.token_to_id(s) is not None]
        if present:
            found[role] = present[0]
    return found


def _tokenizer_files(tokenizer_file: Path, cfg: EncoderConfig) -> dict[str, str]:
    """tokenizer_config.json and special_tokens_map.json for the release's tokenizer.json."""
    special = _special_tokens(tokenizer_file)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": cfg.max_position_embeddings,
        "padding_side": "right",
        "truncation_side": "right",
        "model_input_names": ["input_ids", "token_type_ids", "attention_mask"],
        "clean_up_tokenization_spaces": False,
    }
    return {
        TOKENIZER_CONFIG_FILE: json.dumps(config, indent=2) + "\n",
        SPECIAL_TOKENS_FILE: json.dumps(special, indent=2) + "\n",
    }


def _remote_config(cfg: EncoderConfig, head: dict[str, Any]) -> dict[str, Any]:
    head_type = head.get("type", "pretraining")
    config: dict[str, Any] = {
        "model_type": EXPORT_MODEL_TYPE,
        "architectures": [ARCHITECTURES[head_type]],
        "auto_map": dict(AUTO_MAP),
        **config_to_dict(cfg),
        "classifier_pooling": head.get("pooling", "cls"),
        "classifier_dropout": head.get("classifier_dropout"),
        "tie_word_embeddings": False,  # the MLM decoder reads the embedding itself
    }
    if head_type == "sequence_classification":
        num_labels = int(head.get("num_labels", 2))
        config["id2label"] = {str(i): f"LABEL_{i}" for i in range(num_labels)}
        config["label2id"] = {f"LABEL_{i}": i for i in range(num_labels)}
        if num_labels == 1:
            config["problem_type"] = "regression"
    return config


def _check_exportable(release: Path, cfg: EncoderConfig, head: dict[str, Any]):
    family = ATTENTION_REGISTRY.get(cfg.attention)
    if family.hf_export is None:
        raise ExportError(
            f"release {release}: attention family {cfg.attention!r} has no Hugging Face export "
            "(its AttentionFamily entry gives no hf_export: the family's HF-side modeling code "
            "and weight names); families that have one: "
            f"{[n for n in ATTENTION_REGISTRY.names() if ATTENTION_REGISTRY.get(n).hf_export]}"
        )
    head_type = head.get("type", "pretraining")
    if head_type not in ARCHITECTURES:
        raise ExportError(
            f"release {release}: head {head_type!r} has no `transformers` counterpart; "
            f"exportable heads: {sorted(ARCHITECTURES)}"
        )
    return family


def export_hf(
    release_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    card: ModelCardInfo | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes the Hugging Face directory of the release ``release_dir`` to ``out`` (atomically:
    a temporary directory renamed into place). An existing non-empty ``out`` is an error
    (FileExistsError) unless ``overwrite``."""
    release = Path(release_dir)
    if not is_release(release):
        raise ExportError(
            f"{release} is not a release directory (no {CONFIG_FILE} with a format_version): "
            "export a pretraining run directory or a release"
        )
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} already exists and is not empty (pass overwrite=True)")
    release_config = read_release_config(release)
    model = load_release(release).eval()
    cfg: EncoderConfig = model.config
    head = model.head_config()
    family = _check_exportable(release, cfg, head)
    state = materialised_state_dict(model)
    native: NativeModel | None = None
    why_remote = None
    if family.hf_export.native is not None:
        try:
            native = family.hf_export.native(cfg, head, state)
        except NotNative as e:
            why_remote = str(e)
            log.info("%s: %s; exported with remote code", release, e)
    tokenizer = release / TOKENIZER_FILE
    has_tokenizer = tokenizer.is_file()
    if not has_tokenizer:
        log.warning("release %s has no %s: the export has no tokenizer", release, TOKENIZER_FILE)
    if native is not None:
        config, weights = dict(native.config), native.state_dict
        if has_tokenizer:  # ALBERT's bos/eos are [CLS] and [SEP]
            special = _special_tokens(tokenizer)
            ids = _token_ids(tokenizer, special)
            config.update(bos_token_id=ids.get("cls_token"), eos_token_id=ids.get("sep_token"))
    else:
        config, weights = _remote_config(cfg, head), state
    config["albatross"] = {
        "format_version": release_config["format_version"],
        "attention": cfg.attention,
        "head": head,
        "remote_code": native is None,
        **({"why_remote_code": why_remote} if why_remote else {}),
        **({"extra": release_config["extra"]} if release_config.get("extra") else {}),
    }
    config.setdefault("dtype", "float32")
    card_text = model_card(
        cfg, head, weights, native is None, card or ModelCardInfo(), bool(orthogonal_modules(model))
    )

    out.parent.mkdir(parents=True, exist_ok=True)
    with staged_directory(out, "a Hugging Face export", replace=True) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(
            {k: v.contiguous() for k, v in weights.items()},
            str(tmp / WEIGHTS_FILE),
            metadata={"format": "pt"},
        )
        if native is None:
            for name in REMOTE_FILES:
                shutil.copyfile(REMOTE_CODE / name, tmp / name)
            shutil.copyfile(family.hf_export.code, tmp / FAMILY_FILE)
        if has_tokenizer:
            shutil.copyfile(tokenizer, tmp / TOKENIZER_FILE)
            for name, text in _tokenizer_files(tokenizer, cfg).items():
                (tmp / name).write_text(text)
        (tmp / CARD_FILE).write_text(card_text)
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():  # safetensors writes 0600
            f.chmod(0o666 & ~umask)
    return out


def _token_ids(tokenizer_file: Path, special: dict[str, str]) -> dict[str, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    return {role: tok.token_to_id(token) for role, token in special.items()}


# ----------------------------------------------------------------------------- model card


def _metric_type(name: str) -> str:
    """eval/loss/mlm -> mlm_loss (a model-index metric type)."""
    parts = name.removeprefix("eval/").split("/")
    return "_".join(reversed(parts))


def _yaml_list(items: list[str]) -> str:
    return "".join(f"\n- {item}" for item in items)


def _table(rows: dict[str, Any]) -> str:
    lines = ["| | |", "|---|---|"]
    lines += [f"| {key} | {_fmt(value)} |" for key, value in rows.items()]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return "`" + json.dumps(value, sort_keys=True) + "`"
    return str(value).replace("|", "\\|")


def model_card(
    cfg: EncoderConfig,
    head: dict[str, Any],
    weights: dict[str, torch.Tensor],
    remote: bool,
    info: ModelCardInfo,
    orthogonal_maps: bool = False,
) -> str:
    """The export's README.md: YAML front matter (library_name, license, tags, pipeline_tag,
    model-index with the validation metrics) and a description."""
    family = ATTENTION_REGISTRY.get(cfg.attention)
    params = sum(t.numel() for t in weights.values())
    tags = ["albatross", "fill-mask", "pytorch", f"{cfg.attention}-attention"]
    tags.append("custom_code" if remote else "albert")
    front = [
        "---",
        "library_name: transformers",
        "license: apache-2.0",
        f"tags:{_yaml_list(tags)}",
        "pipeline_tag: fill-mask" if head.get("type") == "pretraining" else "",
    ]
    front = [line for line in front if line]
    if info.validation:
        metrics = "".join(
            f"\n      - type: {_metric_type(name)}\n        value: {value:.6g}\n"
            f"        name: validation {name.removeprefix('eval/')}"
            for name, value in info.validation.items()
            if "loss" in name or "accuracy" in name
        )
        front.append(
            "model-index:\n- name: albatross-" + cfg.attention + "\n  results:\n"
            "  - task:\n      type: fill-mask\n      name: masked language modeling\n"
            "    dataset:\n      type: held-out\n      name: held-out validation split\n"
            "    metrics:" + metrics
        )
    front.append("---")
    load_kw = ", trust_remote_code=True" if remote else ""
    sizes = {
        "parameters": f"{params:,} (with the tied MLM decoder counted once)",
        "vocabulary": cfg.vocab_size,
        "embedding width e": cfg.embedding_size,
        "hidden width d": cfg.hidden_size,
        "layer applications (depth)": cfg.num_layer_applications,
        "distinct layer groups x layers per group": (
            f"{cfg.num_hidden_groups} x {cfg.inner_group_num}"
        ),
        "attention heads": cfg.num_attention_heads,
        "feed-forward width": cfg.intermediate_size,
        "max positions": cfg.max_position_embeddings,
        "residual": cfg.residual,
        "position embedding": cfg.position_embedding,
    }
    key = options_key(ATTENTION_REGISTRY.get(cfg.attention))
    settings = None if key is None else getattr(cfg, key)
    family_settings = (
        f"\nFamily settings (`{key}`): `{json.dumps(config_to_dict(settings))}`\n"
        if settings is not None
        else ""
    )
    body = [
        f"# albatross {cfg.attention} encoder",
        "",
        f"An ALBERT-style encoder with **{cfg.attention}** attention ({family.description}), "
        "pretrained with albatross (masked LM + sentence-order prediction). Head: "
        f"`{head.get('type', 'pretraining')}`.",
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModel, AutoModelForMaskedLM, AutoTokenizer, pipeline",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("PATH"{load_kw})',
        f'model = AutoModel.from_pretrained("PATH"{load_kw})',
        f'mlm = AutoModelForMaskedLM.from_pretrained("PATH"{load_kw})',
        f'fill = pipeline("fill-mask", model="PATH"{load_kw})',
        'fill("the [MASK] of the function")',
        "```",
        "",
        (
            "The modeling code is in this repository (`modeling_albatross.py`, "
            "`albatross_family.py`; `torch` and `transformers` only), hence "
            "`trust_remote_code=True`. "
            + (
                "Orthogonal maps are stored as their matrices; fine-tuning them here does not "
                "keep them orthogonal."
                if orthogonal_maps
                else ""
            )
            if remote
            else "A native `transformers` ALBERT checkpoint: no remote code."
        ),
        "",
        "## Sizes",
        "",
        _table(sizes),
        family_settings,
        "## Training",
        "",
        f"Source: {info.source or 'not recorded'}"
        + (f"; step {info.step:,}" if info.step is not None else "")
        + (f"; {info.tokens:,} tokens" if info.tokens is not None else "")
        + ".",
        "",
        "### Recipe",
        "",
        _table(info.recipe) if info.recipe else "Not recorded in the release.",
        "",
        "### Data",
        "",
        _table(info.data) if info.data else "Not recorded in the release.",
        "",
        "## Validation",
        "",
        (
            (f"At step {info.validation_step:,}, on the held-out validation split:\n\n")
            if info.validation_step is not None
            else "On the held-out validation split:\n\n"
        )
        + _table(info.validation)
        if info.validation
        else "No validation metrics were recorded for these weights.",
        "",
    ]
    return "\n".join(front) + "\n\n" + "\n".join(body)


# ----------------------------------------------------------------------------- import


def is_export(path: str | os.PathLike) -> bool:
    """An export with remote code (``model_type: albatross``)?"""
    try:
        config = json.loads((Path(path) / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") == EXPORT_MODEL_TYPE


@dataclass
class ImportReport:
    loaded: list[str] = field(default_factory=list)
    initialised: list[str] = field(default_factory=list)
    """Our tensors the export does not hold (e.g. the SOP head of a masked-LM save)."""
    unused: list[str] = field(default_factory=list)
    orthogonal_error: float = 0.0
    """Largest |cayley(X) - W| over the orthogonal maps given back their free parameters."""


def export_encoder_config(hf_dir: str | os.PathLike) -> EncoderConfig:
    """The encoder config of an export with remote code (``model_type: albatross``), read from
    its ``config.json`` alone (no weights). ValueError naming the file for a directory that is
    not one."""
    return _export_config(Path(hf_dir))[1]


def _export_config(hf: Path) -> tuple[dict[str, Any], EncoderConfig]:
    """(the export's config.json, its encoder config)."""
    path = hf / CONFIG_FILE
    if not is_export(hf):
        raise ReleaseError(f"{path}: not an albatross export (model_type {EXPORT_MODEL_TYPE!r})")
    config = json.loads(path.read_text())
    keys = config_keys(EncoderConfig)  # its fields and the registered families' sections
    encoder = {k: v for k, v in config.items() if k in keys}
    if encoder.get("orthogonal_map", "cayley") != "cayley":
        log.warning(
            "%s: orthogonal_map=%r; the import gives the matrices back free parameters of the "
            "Cayley map (same matrices, another parametrisation for further training)",
            path,
            encoder["orthogonal_map"],
        )
        encoder["orthogonal_map"] = "cayley"
    return config, config_from_dict(EncoderConfig, encoder)


def _exported_head(config: dict[str, Any]) -> dict[str, Any]:
    """The head an export's ``architectures`` names."""
    arch = (config.get("architectures") or ["AlbatrossForPreTraining"])[0]
    if arch == "AlbatrossForSequenceClassification":
        return {
            "type": "sequence_classification",
            "num_labels": len(config.get("id2label") or {}) or int(config.get("num_labels", 2)),
            "pooling": config.get("classifier_pooling", "cls"),
            "classifier_dropout": config.get("classifier_dropout"),
        }
    return {"type": "pretraining"}


def import_export(
    hf_dir: str | os.PathLike, head: dict[str, Any] | None = None
) -> tuple[torch.nn.Module, ImportReport]:
    """This project's model (eval mode) from an export with remote code (``model_type:
    albatross``), and what was loaded. ValueError naming the file for a directory that is not
    one, or for a matrix that is no longer orthogonal (trained outside this project).

    ``head`` (e.g. {"type": "sequence_classification", "num_labels": 2}) replaces the exported
    one, as `model.hub.release.load_release` does: the encoder's tensors must all load, the head's
    load where names and shapes match (fine-tuning or continued pretraining from an export)."""
    hf = Path(hf_dir)
    path = hf / CONFIG_FILE
    config, cfg = _export_config(hf)
    callers_head = head is not None
    model = build_model(cfg, head if head is not None else _exported_head(config))
    weights_path = hf / WEIGHTS_FILE
    if not weights_path.is_file():
        raise FileNotFoundError(f"{weights_path} not found: the export {hf} has no weights")
    state = load_file(str(weights_path))
    if state and not any(k.startswith("encoder.") for k in state):  # saved from AutoModel
        state = {f"encoder.{k}": v for k, v in state.items()}
    report = ImportReport()
    own = model.state_dict()
    updates: dict[str, torch.Tensor] = {}
    for key, tensor in own.items():
        if ".parametrizations." in key:
            owner, rest = key.split(".parametrizations.", 1)
            name, what = rest.split(".", 1)
            plain = f"{owner}.{name}"
            if what != "original" or plain not in state:
                continue
            W = state[plain].float()
            X = cayley_inverse(W)
            error = (cayley(X.double()).float() - W).abs().max().item()
            if not error <= ORTHOGONAL_TOLERANCE:
                raise ReleaseError(
                    f"{weights_path}: {plain} is not an orthogonal matrix of the Cayley map "
                    f"(|cayley(X) - W| = {error:.2g} after inversion): trained outside this "
                    "project? Its orthogonal parametrisation cannot be restored"
                )
            report.orthogonal_error = max(report.orthogonal_error, error)
            updates[key] = X.to(tensor.dtype)
            report.loaded.append(plain)
        elif key in state:
            if (
                callers_head
                and not key.startswith("encoder.")
                and (tuple(state[key].shape) != tuple(tensor.shape))
            ):
                continue  # the caller's head: this tensor stays newly initialised
            if tuple(state[key].shape) != tuple(tensor.shape):
                raise ReleaseError(
                    f"{weights_path}: {key} has shape {tuple(state[key].shape)}, the config in "
                    f"{path} makes {tuple(tensor.shape)}"
                )
            updates[key] = state[key].to(tensor.dtype)
            report.loaded.append(key)
    missing_encoder = sorted(k for k in own if k.startswith("encoder.") and k not in updates)
    if missing_encoder:
        raise ReleaseError(f"{weights_path} lacks encoder tensors: {missing_encoder[:5]}")
    report.initialised = sorted(set(own) - updates.keys())
    plain_own = {_plain_name(k) for k in own}
    report.unused = sorted(set(state) - plain_own)
    own.update(updates)
    model.load_state_dict(own, strict=True)
    if report.initialised:
        log.info("%s: newly initialised (not in the export): %s", hf, report.initialised)
    return model.eval(), report


def load_release_or_export(
    path: str | os.PathLike, head: dict[str, Any] | None = None
) -> torch.nn.Module:
    """A release directory or this project's HF export (any family, e.g. a Hub download) as
    this project's model; ``head`` replaces the saved one (`load_release`, `import_export`)."""
    if is_export(path):
        return import_export(path, head=head)[0]
    return load_release(path, head=head)


def release_or_export_encoder(path: str | os.PathLike) -> dict[str, Any]:
    """The encoder section (a dict) of a release or of this project's HF export."""
    if is_export(path):
        return export_encoder_config(path).to_dict()
    return dict(read_release_config(path)["encoder"])


__all__ = [
    "ExportError",
    "ImportReport",
    "ModelCardInfo",
    "cayley_inverse",
    "export_encoder_config",
    "export_hf",
    "import_export",
    "is_export",
    "load_release_or_export",
    "materialised_state_dict",
    "release_or_export_encoder",
]
