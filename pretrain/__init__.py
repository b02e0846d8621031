"""Pretraining (`python -m pretrain`, issue #4). Today: `pretrain.smoke`, the model smoke run
that the README's main command executes until the full pipeline lands."""
