"""The project's compute kernels: for each op a plain PyTorch reference, the vectorised
torch path the engine runs off CUDA, and a Triton kernel for CUDA, all with the
reference's signature (``dispatch.KERNELS`` lists them). Nothing here imports vLLM, so the
kernels run and are verified on a machine without it (``tools/verify_kernels.py``)."""
