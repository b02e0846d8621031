"""Fine-tuning on GLUE and Long Range Arena (`python -m finetune`)."""
