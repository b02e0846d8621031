"""Training machinery shared by pretraining and fine-tuning: distributed init (torchrun, Slurm),
the DeepSpeed engine, optimizers and schedules, checkpointing, TensorBoard."""
