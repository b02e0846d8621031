"""The error that stops a run after too many non-finite steps in a row: it names the checkpoint
of the last good weights, and points at the compiler when a compiled run never had one good
step (what a compiled TransJect recipe did on a GPU)."""

from __future__ import annotations

from pretrain.train import nonfinite_message


def test_message_names_the_run_and_the_checkpoint():
    text = nonfinite_message(3, 9, 5, "runs/x/checkpoints/step_00000009", compiled=False)
    assert "not finite in 3 steps in a row" in text and "up to step 9" in text
    assert "5 skipped in all" in text and "runs/x/checkpoints/step_00000009" in text
    assert "engine.compile" not in text


def test_compiled_run_without_one_good_step_points_at_the_compiler():
    assert "engine.compile=false" in nonfinite_message(3, 3, 3, "ckpt", compiled=True)
    # Some steps were good: the compiler is no more suspect than the data or the lr.
    assert "engine.compile" not in nonfinite_message(3, 9, 3, "ckpt", compiled=True)
    assert "engine.compile" not in nonfinite_message(3, 3, 3, "ckpt", compiled=False)
