"""Configuration of an albatross encoder exported for Hugging Face `transformers` (remote code).

Written by albatross's export (``python -m pretrain.export --format hf``); depends on
`transformers` only. The fields are the encoder config of the albatross release, under the same
names (most of them ALBERT's): the attention family (``attention``) and its settings (``tisa``,
``kernel``, ``transject``), plus the classification head's ``classifier_pooling`` and
``classifier_dropout``.
"""

from transformers import PretrainedConfig


class AlbatrossConfig(PretrainedConfig):
    model_type = "albatross"

    def __init__(
        self,
        attention="softmax",
        vocab_size=30000,
        embedding_size=128,
        hidden_size=768,
        num_hidden_layers=12,
        num_hidden_groups=1,
        inner_group_num=1,
        num_attention_heads=12,
        intermediate_size=3072,
        hidden_act="gelu_new",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=512,
        type_vocab_size=2,
        layer_norm_eps=1e-12,
        initializer_range=0.02,
        pad_token_id=0,
        position_embedding="absolute",
        residual="post_ln",
        orthogonal=False,
        orthogonal_map="cayley",
        tisa=None,
        kernel=None,
        transject=None,
        classifier_pooling="cls",
        classifier_dropout=None,
        **kwargs,
    ):
        self.attention = attention
        self.vocab_size = vocab_size
        self.embedding_size = embedding_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_hidden_groups = num_hidden_groups
        self.inner_group_num = inner_group_num
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.max_position_embeddings = max_position_embeddings
        self.type_vocab_size = type_vocab_size
        self.layer_norm_eps = layer_norm_eps
        self.initializer_range = initializer_range
        self.position_embedding = position_embedding
        self.residual = residual
        # The export holds the orthogonal matrices themselves: `orthogonal` and `orthogonal_map`
        # only say how albatross parameterised them in training (an import back uses them).
        self.orthogonal = orthogonal
        self.orthogonal_map = orthogonal_map
        self.tisa = dict(tisa or {})
        self.kernel = dict(kernel or {})
        self.transject = dict(transject or {})
        self.classifier_pooling = classifier_pooling
        self.classifier_dropout = classifier_dropout
        super().__init__(pad_token_id=pad_token_id, **kwargs)
        self.pad_token_id = pad_token_id


__all__ = ["AlbatrossConfig"]
