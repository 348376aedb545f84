"""headrace.training: config, device mesh, parallelisms, model, train loop, checkpoints, metrics."""

from headrace.training.import_noise import silence_torchao_import_noise

# Before any module of this package imports transformers (which imports torchao when installed).
silence_torchao_import_noise()
