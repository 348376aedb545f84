"""Speech-LLM training (SALM): speech encoder + modality adapter + a transformers causal LM."""
