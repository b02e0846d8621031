"""Fine-tuning on GLUE and Long Range Arena (`python -m finetune`). Built by issues #6 and #7."""
