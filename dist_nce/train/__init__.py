"""Ray Train + DeepSpeed training loop, batch assembly, refresh schedule, checkpoints."""
