"""The ALBERT checkpoint format of Hugging Face `transformers`: its files, config fields,
architectures and activations, and the one table of tensor names between its checkpoints and
our model (`hf_name_map`), read forwards by the import (`model.hub.hf_import`) and backwards by the
export of a softmax model as a native ALBERT (`albert_export`). Builds no model, so the softmax
family's export hook can use it without an import cycle."""

from __future__ import annotations

from typing import Any

import torch

from model.config import EncoderConfig

HF_CONFIG_FILE = "config.json"
HF_TOKENIZER_FILE = "tokenizer.json"
# In order of preference; an `.index.json` names the shards of a sharded checkpoint.
HF_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)

IMPORTABLE_ATTENTION = ("softmax", "tisa")
"""Families whose imported model reproduces the HF outputs (TISA at zero amplitude). Kernel
attention and TransJect replace the softmax mixing (or the whole layer), so nothing to import."""

# HF `hidden_act` -> ours. `gelu_pytorch_tanh` is the same tanh approximation as `gelu_new`;
# HF's `swish` is SiLU.
HF_ACTIVATIONS = {
    "gelu_new": "gelu_new",
    "gelu_pytorch_tanh": "gelu_new",
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}

# HF config field -> EncoderConfig field, copied as they are (after the checks below).
HF_CONFIG_FIELDS = {
    "vocab_size": "vocab_size",
    "embedding_size": "embedding_size",
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_hidden_layers",
    "num_hidden_groups": "num_hidden_groups",
    "inner_group_num": "inner_group_num",
    "num_attention_heads": "num_attention_heads",
    "intermediate_size": "intermediate_size",
    "hidden_dropout_prob": "hidden_dropout_prob",
    "attention_probs_dropout_prob": "attention_probs_dropout_prob",
    "max_position_embeddings": "max_position_embeddings",
    "type_vocab_size": "type_vocab_size",
    "layer_norm_eps": "layer_norm_eps",
    "initializer_range": "initializer_range",
    "pad_token_id": "pad_token_id",
}

# HF architecture -> our head type. The other ALBERT task heads (token classification,
# question answering, multiple choice) have no counterpart here and are rejected.
HF_ARCHITECTURES = {
    "AlbertModel": "pretraining",
    "AlbertForPreTraining": "pretraining",
    "AlbertForMaskedLM": "pretraining",
    "AlbertForSequenceClassification": "sequence_classification",
}

# Name mapping, ours -> HF (HF names without the optional `albert.` prefix of task models).
# Each row is (our module, HF module); `.weight` / `.bias` are appended for each tensor.
EMBEDDING_MODULES = (
    ("encoder.embeddings.word_embeddings", "embeddings.word_embeddings"),
    ("encoder.embeddings.position_embeddings", "embeddings.position_embeddings"),
    ("encoder.embeddings.token_type_embeddings", "embeddings.token_type_embeddings"),
    ("encoder.embeddings.norm", "embeddings.LayerNorm"),
    ("encoder.embeddings.projection", "encoder.embedding_hidden_mapping_in"),
    ("encoder.pooler", "pooler"),
)
# Per layer `i` of group `g`: ours `encoder.groups.{g}.{i}.X`, HF
# `encoder.albert_layer_groups.{g}.albert_layers.{i}.Y`.
LAYER_MODULES = (
    ("attention.query", "attention.query"),
    ("attention.key", "attention.key"),
    ("attention.value", "attention.value"),
    ("attention.output", "attention.dense"),
    ("attn_norm", "attention.LayerNorm"),
    ("ffn_in", "ffn"),
    ("ffn_out", "ffn_output"),
    ("ffn_norm", "full_layer_layer_norm"),
)
HEAD_MODULES = {
    "pretraining": (
        ("mlm.dense", "predictions.dense"),
        ("mlm.norm", "predictions.LayerNorm"),
        ("sop", "sop_classifier.classifier"),
    ),
    "sequence_classification": (("classifier", "classifier"),),
}
# Single tensors; a tuple lists the HF names to try, in order. HF ties `predictions.decoder.bias`
# to `predictions.bias` (5.x loads the latter into both); old checkpoints may hold either.
HEAD_TENSORS = {
    "pretraining": (("mlm.bias", ("predictions.bias", "predictions.decoder.bias")),),
    "sequence_classification": (),
}
TIED_DECODER_WEIGHT = "predictions.decoder.weight"
"""HF's MLM decoder weight, tied to the word embedding (often absent from safetensors files)."""

IGNORABLE_HF_TENSORS = {
    "embeddings.position_ids",  # buffers, saved by old versions
    "embeddings.token_type_ids",
    TIED_DECODER_WEIGHT,  # checked equal to the word embedding, see `load_hf_weights`
    "predictions.decoder.bias",  # tied to predictions.bias
}


def hf_name_map(cfg: EncoderConfig, head_type: str) -> dict[str, tuple[str, ...]]:
    """Our state_dict key -> the HF names (first found wins) it is copied from.

    Covers every tensor of a softmax model with head `head_type`; anything else in our model
    (e.g. TISA's scorer) has no HF counterpart and is left at its initialisation.
    """
    modules = list(EMBEDDING_MODULES)
    for g in range(cfg.num_hidden_groups):
        for i in range(cfg.inner_group_num):
            ours = f"encoder.groups.{g}.{i}"
            theirs = f"encoder.albert_layer_groups.{g}.albert_layers.{i}"
            modules += [(f"{ours}.{a}", f"{theirs}.{b}") for a, b in LAYER_MODULES]
    modules += HEAD_MODULES[head_type]
    names: dict[str, tuple[str, ...]] = {}
    for ours, theirs in modules:
        for tensor in ("weight", "bias"):
            names[f"{ours}.{tensor}"] = (f"{theirs}.{tensor}",)
    # Embeddings have no bias.
    for ours, _ in EMBEDDING_MODULES:
        if ours.endswith("_embeddings"):
            del names[f"{ours}.bias"]
    names.update(dict(HEAD_TENSORS[head_type]))
    return names


# ----------------------------------------------------------------------------- export


HF_ARCHITECTURE_OF_HEAD = {
    "pretraining": "AlbertForPreTraining",
    "sequence_classification": "AlbertForSequenceClassification",
}
"""The native `transformers` class an export of each of our heads becomes."""


def albert_export(cfg: EncoderConfig, head: dict[str, Any], state: dict[str, torch.Tensor]):
    """A softmax model as a native `transformers` ALBERT checkpoint: the inverse of the import
    (`hf_name_map` read backwards). `state` holds our tensors (orthogonal maps as matrices).

    Raises `NotNative` naming what ALBERT cannot represent: residuals other than post-LN, no
    absolute positions, orthogonal projections (a round trip would lose their
    parametrisation), a layer schedule that HF computes differently, a head other than
    pretraining or ``cls``-pooled classification.
    """
    from model.attention.hf_export import NativeModel, NotNative

    head_type = head.get("type", "pretraining")
    faults = [
        f"{name}={value!r} (ALBERT: {albert!r})"
        for name, value, albert in (
            ("residual", cfg.residual, "post_ln"),
            ("position_embedding", cfg.position_embedding, "absolute"),
            ("orthogonal", cfg.orthogonal, False),
        )
        if value != albert
    ]
    if hf_group_schedule(cfg.num_hidden_layers, cfg.num_hidden_groups) != cfg.group_schedule():
        faults.append(
            f"num_hidden_layers={cfg.num_hidden_layers} with num_hidden_groups="
            f"{cfg.num_hidden_groups} (ALBERT computes another layer schedule)"
        )
    if head_type not in HF_ARCHITECTURE_OF_HEAD:
        faults.append(f"head {head_type!r}")
    elif head_type == "sequence_classification" and head.get("pooling", "cls") != "cls":
        faults.append(f"pooling={head['pooling']!r} (ALBERT classifies the pooler output)")
    if faults:
        raise NotNative("not a native ALBERT: " + ", ".join(faults))
    names = hf_name_map(cfg, head_type)
    hf_state: dict[str, torch.Tensor] = {}
    for ours, candidates in names.items():
        theirs = candidates[0]
        hf_state[("albert." if ours.startswith("encoder.") else "") + theirs] = state[ours]
    left = sorted(set(state) - names.keys())
    assert not left, f"tensors with no ALBERT name: {left}"
    config: dict[str, Any] = {
        theirs: getattr(cfg, ours) for theirs, ours in HF_CONFIG_FIELDS.items()
    }
    config.update(
        model_type="albert",
        architectures=[HF_ARCHITECTURE_OF_HEAD[head_type]],
        hidden_act=cfg.hidden_act,  # gelu_new, gelu, relu, silu: all ALBERT activations
        position_embedding_type="absolute",
        tie_word_embeddings=True,
        classifier_dropout_prob=cfg.hidden_dropout_prob,
    )
    if head_type == "sequence_classification":
        num_labels = int(head.get("num_labels", 2))
        dropout = head.get("classifier_dropout")
        config.update(
            num_labels=num_labels,
            id2label={str(i): f"LABEL_{i}" for i in range(num_labels)},
            label2id={f"LABEL_{i}": i for i in range(num_labels)},
            classifier_dropout_prob=cfg.hidden_dropout_prob if dropout is None else dropout,
        )
        if num_labels == 1:
            config["problem_type"] = "regression"
    return NativeModel(config=config, state_dict=hf_state)


def normalise_hf_key(key: str) -> str:
    """Drops the `albert.` prefix of task models; renames old `gamma`/`beta` LayerNorm tensors."""
    key = key.removeprefix("albert.")
    if key.endswith(".gamma"):
        key = key[: -len("gamma")] + "weight"
    elif key.endswith(".beta"):
        key = key[: -len("beta")] + "bias"
    return key


# ----------------------------------------------------------------------------- config


def hf_hidden_act(value: Any) -> str:
    if value not in HF_ACTIVATIONS:
        raise ValueError(
            f"HF hidden_act={value!r} is not supported; supported: {sorted(HF_ACTIVATIONS)}"
        )
    return HF_ACTIVATIONS[value]


def hf_group_schedule(num_hidden_layers: int, num_hidden_groups: int) -> list[int]:
    """The group run at each application, as HF computes it (in floating point)."""
    return [int(i / (num_hidden_layers / num_hidden_groups)) for i in range(num_hidden_layers)]
