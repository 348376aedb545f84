"""What the trainer holds besides the model: checkpoints, metrics, optimizer, profiler, W&B."""
