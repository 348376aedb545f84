"""Building a transformers causal LM on the meta device, the families it takes, the loss wrapper."""
