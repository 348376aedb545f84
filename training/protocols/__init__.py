"""The specs of model kinds (the trainer calls through them: headrace.training.model_kinds)."""
