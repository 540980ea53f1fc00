"""Running Triton-vs-torch comparisons natively on CUDA or through Triton's interpreter.

TRITON_INTERPRET=1 must be set before Triton is first imported, and vLLM imports Triton
early, so on CPU the comparisons run in a subprocess: the test file executed as a script
prints ``max_errors("cpu")`` as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

import torch


def kernel_errors(test_file: str, max_errors: Callable[[str], dict[str, float]]) -> dict[str, float]:
    if torch.cuda.is_available():
        return max_errors("cuda")
    result = subprocess.run([sys.executable, test_file], capture_output=True, text=True,
                            timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def torch_side(args: tuple, cache_index: int = 1) -> tuple:
    """``args`` of a paged-attention op, built with an interleaved cache as the Triton
    kernels read it, for the torch code on the same device (on CPU: the split copy)."""
    from vllm_diffusion.kernels.kv_pages import interleaved_as_read_here

    return (*args[:cache_index], interleaved_as_read_here(args[cache_index]),
            *args[cache_index + 1:])
