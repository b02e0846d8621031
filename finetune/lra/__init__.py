"""Long Range Arena fine-tuning: the tasks and their shared vocabulary (tasks.py) and the
loaders of the official data formats (data.py)."""
