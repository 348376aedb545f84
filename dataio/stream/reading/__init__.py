"""The reading stage of the stream: a batch's samples read and decoded, collated (token batches gathered at batch
level, audio decoded into the batch), in forked worker processes read back in order."""
