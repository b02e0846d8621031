"""Pretraining: ``python -m pretrain --config configs/pretrain/<recipe>.yaml [key=value ...]``
(the loop: ``pretrain.train``), ``python -m pretrain.export`` (a release from a checkpoint) and
``python -m pretrain.pipeline`` (the README's main job)."""
