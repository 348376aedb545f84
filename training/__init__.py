"""headrace.training: config, device mesh, parallelisms, model, train loop, checkpoints, metrics."""
