"""What happens to a batch between the loader and the step: the context-parallel split of packed rows, device
prefetch, and evening out a finite stream over the ranks. None of them batches anything."""
