"""ALBERT's factorised embeddings: token + position + type (width e), LayerNorm, dropout, e -> d.

Legend: B batch, N tokens, e embedding width, d hidden width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from model.config import EncoderConfig
from model.norm import layer_norm
from model.orthogonal import Linear


class AlbertEmbeddings(nn.Module):
    """input ids (B, N) -> (B, N, d). `token_embedding_weight` is what the MLM decoder ties to."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        e = cfg.embedding_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, e)
        self.position_embeddings = (
            nn.Embedding(cfg.max_position_embeddings, e)
            if cfg.position_embedding == "absolute"
            else None
        )
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, e)
        self.norm = layer_norm(cfg, e)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.projection = Linear(e, cfg.hidden_size)
        self.max_positions = cfg.max_position_embeddings

    @property
    def token_embedding_weight(self) -> Tensor:
        return self.word_embeddings.weight

    def forward(self, input_ids_BN: Tensor, token_type_ids_BN: Tensor | None = None) -> Tensor:
        N = input_ids_BN.shape[1]
        x_BNe = self.word_embeddings(input_ids_BN)
        if self.position_embeddings is not None:
            if self.max_positions < N:
                raise ValueError(
                    f"sequence length {N} exceeds max_position_embeddings={self.max_positions}"
                )
            positions_N = torch.arange(N, device=input_ids_BN.device)
            x_BNe = x_BNe + self.position_embeddings(positions_N)
        if token_type_ids_BN is None:
            token_type_ids_BN = torch.zeros_like(input_ids_BN)
        x_BNe = x_BNe + self.token_type_embeddings(token_type_ids_BN)
        x_BNe = self.dropout(self.norm(x_BNe))
        return self.projection(x_BNe)
