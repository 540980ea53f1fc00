"""One dispatch for every kernel: ``kernel(name, device)`` is the op's Triton kernel for
CUDA tensors and its vectorised torch path elsewhere. ``KERNELS`` names, per op, the
reference, the torch path and the Triton kernel (``module:function``, one signature);
Triton modules are imported only when a CUDA tensor first asks for them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable

import torch

_PACKAGE = "vllm_diffusion.kernels"


@dataclasses.dataclass(frozen=True)
class KernelOp:
    reference: str  # the plain PyTorch reference
    torch_path: str  # what runs off CUDA
    triton: str  # what runs on CUDA


KERNELS: dict[str, KernelOp] = {
    "block_attention": KernelOp("block_attention:block_causal_attention",
                                "block_attention:padded_block_causal_attention",
                                "triton_block_attention:block_causal_attention"),
    "sparse_prefix_attention": KernelOp(
        "sparse_prefix:sparse_prefix_attention",
        "sparse_prefix:compacted_sparse_prefix_attention",
        "triton_sparse_prefix:sparse_prefix_attention"),
    "candidate_importance": KernelOp("importance:looped_candidate_importance",
                                     "importance:batched_candidate_importance",
                                     "triton_importance:batched_candidate_importance"),
    "select_retained": KernelOp("selection:batched_select_retained",
                                "selection:vectorised_select_retained",
                                "triton_selection:batched_select_retained"),
    "compact_rows": KernelOp("compaction:compact_rows", "compaction:compact_rows",
                             "triton_compaction:compact_rows"),
}


def resolve(path: str) -> Callable:
    """The function at ``module:function`` (module relative to this package)."""
    module, function = path.split(":")
    return getattr(importlib.import_module(f"{_PACKAGE}.{module}"), function)


@functools.lru_cache(maxsize=None)
def _for_device_type(name: str, device_type: str) -> Callable:
    op = KERNELS[name]
    return resolve(op.triton if device_type == "cuda" else op.torch_path)


def kernel(name: str, device: torch.device) -> Callable:
    """The implementation of op ``name`` for tensors on ``device``."""
    return _for_device_type(name, torch.device(device).type)
