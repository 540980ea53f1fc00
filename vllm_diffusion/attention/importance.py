"""FOCUS's candidate importance for a whole step, on this device's kernel
(``kernels/importance.py``), summed over the tensor-parallel ranks' heads."""

from __future__ import annotations

import torch

from vllm_diffusion.kernels.dispatch import kernel


def reduce_over_tensor_parallel_heads(scores: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Sum the per-rank head sums across tensor-parallel ranks (each rank holds a slice of
    the heads), so that every rank selects the same positions. A no-op without TP."""
    from vllm.distributed import (get_tensor_model_parallel_world_size,
                                  tensor_model_parallel_all_reduce)

    present = [s for s in scores if s is not None]
    if not present or get_tensor_model_parallel_world_size() == 1:
        return scores
    totals = iter(tensor_model_parallel_all_reduce(torch.cat(present)).split(
        [len(s) for s in present]))
    return [None if s is None else next(totals) for s in scores]


def step_candidate_importance(query: torch.Tensor, key: torch.Tensor,
                              rows: list[torch.Tensor | None], scale: float,
                              pool_kernels: list[int]) -> list[torch.Tensor | None]:
    """``batched_candidate_importance`` with this device's kernel, summed over the
    tensor-parallel ranks' heads (every rank gets the same scores)."""
    scores = kernel("candidate_importance", query.device)(query, key, rows, scale,
                                                        pool_kernels)
    return reduce_over_tensor_parallel_heads(scores)
