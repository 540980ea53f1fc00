"""Triton kernel for ``selection.batched_select_retained`` (CUDA; same signature and
semantics). One program per request ranks candidates by pairwise comparisons (higher delta
first, ties to the lower position), so no sort is needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _select_retained_kernel(delta_ptr, candidates_ptr, budgets_ptr, processing_ptr,
                            ever_processed_ptr, selected_left_ptr, out_ptr, block_size,
                            stride_row,
                            BLOCK: tl.constexpr):
    request = tl.program_id(0)
    base = request * stride_row
    i = tl.arange(0, BLOCK)
    j = tl.arange(0, BLOCK)
    inside = i < block_size
    delta_i = tl.load(delta_ptr + base + i, mask=inside, other=0.0)
    delta_j = tl.load(delta_ptr + base + j, mask=inside, other=0.0)
    cand_i = tl.load(candidates_ptr + base + i, mask=inside, other=0) != 0
    cand_j = tl.load(candidates_ptr + base + j, mask=inside, other=0) != 0
    processing = tl.load(processing_ptr + base + i, mask=inside, other=0) != 0
    ever = tl.load(ever_processed_ptr + base + i, mask=inside, other=0) != 0
    budget = tl.load(budgets_ptr + request)
    selected_left = tl.load(selected_left_ptr + request) != 0

    # rank[i] = candidates ahead of candidate i (higher delta, or equal and lower position)
    ahead = cand_j[None, :] & ((delta_j[None, :] > delta_i[:, None])
                               | ((delta_j[None, :] == delta_i[:, None]) & (j[None, :] < i[:, None])))
    rank = tl.sum(ahead.to(tl.int32), axis=1)
    top = cand_i & (rank < budget)
    retained = (processing & ~cand_i) | top
    # AR-context preservation: the left neighbour (i = j - 1) of every retained j
    # (retained_left), or of every selected j when it is a candidate (selected_left).
    source = tl.where(selected_left, top, retained)
    source_j = tl.sum(tl.where(i[:, None] == j[None, :], source[:, None].to(tl.int32), 0),
                      axis=0) != 0
    left_of = tl.sum(tl.where(j[None, :] == i[:, None] + 1, source_j[None, :].to(tl.int32), 0),
                     axis=1) != 0
    retained = retained | (left_of & tl.where(selected_left, cand_i, processing))
    # Placeholder integrity: never-processed candidates left of the rightmost retained.
    rightmost = tl.max(tl.where(retained & inside, i, -1), axis=0)
    retained = retained | (cand_i & ~ever & (i < rightmost))
    # Never empty.
    any_candidate = tl.sum(cand_i.to(tl.int32), axis=0) > 0
    none = tl.sum(retained.to(tl.int32), axis=0) == 0
    retained = tl.where(none | (~any_candidate & (tl.sum((processing & ~cand_i).to(tl.int32),
                                                         axis=0) == 0)), processing, retained)
    tl.store(out_ptr + base + i, retained.to(tl.int8), mask=inside)


def batched_select_retained(delta: torch.Tensor, candidates: torch.Tensor,
                            budgets: torch.Tensor, processing: torch.Tensor,
                            ever_processed: torch.Tensor,
                            selected_left: torch.Tensor) -> torch.Tensor:
    """See ``selection.batched_select_retained``."""
    requests, block_size = delta.shape
    device = delta.device
    out = torch.empty(requests, block_size, dtype=torch.int8, device=device)
    as_int8 = [t.to(device=device, dtype=torch.int8).contiguous()
               for t in (candidates, processing, ever_processed, selected_left)]
    _select_retained_kernel[(requests,)](
        delta.to(device=device, dtype=torch.float32).contiguous(), as_int8[0],
        budgets.to(device=device, dtype=torch.int32), as_int8[1], as_int8[2], as_int8[3], out,
        block_size, block_size, BLOCK=triton.next_power_of_2(block_size))
    return out.bool()
