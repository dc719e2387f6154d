"""Kernels of the executor: Triton kernels (GPU path) beside their torch references (CPU path).

Keep this module free of heavy imports and of a ``__version__``: ``transformers`` probes for an
unrelated package also named ``kernels``, and must keep concluding that it is not installed.
"""
