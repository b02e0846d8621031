"""Pretraining: ``python -m pretrain --config configs/pretrain/<recipe>.yaml [key=value ...]``
(the loop: ``pretrain.train``) and ``python -m pretrain.export`` (a release from a checkpoint).
The README's main job, which runs every stage, is the ``main`` study (``python -m study run
configs/studies/main.yaml``)."""
