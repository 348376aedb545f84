import os

# Keep torch's intra-op threads from oversubscribing the 2-core CI machine when tests spawn processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
