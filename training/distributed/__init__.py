"""The process group, ParallelDims and its meshes, and each parallelism applied to a model."""
