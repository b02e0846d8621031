"""The main job: every stage, end to end, on the embedded corpus (``python -m main_job``)."""
