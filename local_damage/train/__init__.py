"""Training: config, loop, checkpoints and data-parallel helpers."""
