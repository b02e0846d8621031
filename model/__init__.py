"""albatross model code: single-device, no distributed or DeepSpeed imports.

Main entry points:
    EncoderConfig            typed config with presets (model.config)
    Encoder                  the ALBERT-style encoder (model.encoder)
    EncoderForPretraining, EncoderForSequenceClassification, EncoderForDualClassification
    save_release / load_release   the release directory (model.hub.release)
    ATTENTION_REGISTRY       attention families (model.attention)
"""

from model.attention import ATTENTION_REGISTRY, register_attention
from model.attention.kernel import KernelConfig
from model.attention.tisa import TISAConfig
from model.attention.transject import TransJectConfig
from model.config import EncoderConfig
from model.encoder import Encoder, EncoderOutput
from model.heads import (
    EncoderForDualClassification,
    EncoderForPretraining,
    EncoderForSequenceClassification,
    ModelOutput,
    build_model,
)

__all__ = [
    "ATTENTION_REGISTRY",
    "Encoder",
    "EncoderConfig",
    "EncoderForDualClassification",
    "EncoderForPretraining",
    "EncoderForSequenceClassification",
    "EncoderOutput",
    "KernelConfig",
    "ModelOutput",
    "TISAConfig",
    "TransJectConfig",
    "build_model",
    "register_attention",
]
