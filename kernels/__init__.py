"""headrace.kernels: compute kernels for packed batches, each beside a plain-torch reference.

Kept import-free on purpose: transformers probes ``importlib.util.find_spec("kernels")`` (the name of a
Hugging Face package) and, when it finds no version metadata, imports the module; this package must
stay cheap and must not look like that package (no ``__version__``).
"""
