"""The project's compute kernels (docs/kernels.md). Nothing here imports vLLM, so the
kernels run and are verified on a machine without it (``tools/verify_kernels.py``)."""
