"""Triton kernel for ``importance.batched_candidate_importance`` (CUDA; same signature and
semantics). One program per (request, head) scores the request's candidates against their
pooling neighbours, softmaxes over keys and sums over queries; the heads are summed after.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _importance_kernel(query_ptr, key_ptr, rows_ptr, counts_ptr, kernels_ptr, out_ptr,
                       stride_q_row, stride_q_head, stride_k_row, stride_k_head,
                       stride_rows, stride_out_request, stride_out_head,
                       scale, group_size, head_size,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MAX_HALF: tl.constexpr):
    request = tl.program_id(0)
    head = tl.program_id(1)
    count = tl.load(counts_ptr + request)
    half = tl.load(kernels_ptr + request) // 2
    index = tl.arange(0, BLOCK_N)
    valid = index < count
    rows = tl.load(rows_ptr + request * stride_rows + index, mask=valid, other=0)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_size
    query = tl.load(query_ptr + rows[:, None] * stride_q_row + head * stride_q_head
                    + dims[None, :], mask=valid[:, None] & dim_ok[None, :], other=0.0)
    kv_head = head // group_size
    pooled = tl.full((BLOCK_N, BLOCK_N), float("-inf"), tl.float32)
    for shift in tl.static_range(-MAX_HALF, MAX_HALF + 1):
        # Column b of this tile holds the score against candidate b + shift.
        neighbour = index + shift
        # |shift| <= this request's half width (as a vector: the interpreter needs one)
        in_window = tl.abs(tl.full((BLOCK_N,), shift, tl.int32)) <= half
        neighbour_ok = (neighbour >= 0) & (neighbour < count) & in_window
        neighbour_rows = tl.load(rows_ptr + request * stride_rows + neighbour,
                                 mask=neighbour_ok, other=0)
        keys = tl.load(key_ptr + neighbour_rows[:, None] * stride_k_row
                       + kv_head * stride_k_head + dims[None, :],
                       mask=neighbour_ok[:, None] & dim_ok[None, :], other=0.0)
        scores = tl.dot(query.to(tl.float32), tl.trans(keys.to(tl.float32)),
                        input_precision="ieee") * scale
        scores = tl.where(neighbour_ok[None, :], scores, float("-inf"))
        pooled = tl.maximum(pooled, scores)
    pooled = tl.where(valid[None, :], pooled, float("-inf"))
    row_max = tl.max(pooled, axis=1)
    weights = tl.exp(pooled - row_max[:, None])
    weights = weights / tl.sum(weights, axis=1)[:, None]
    weights = tl.where(valid[:, None], weights, 0.0)
    importance = tl.sum(weights, axis=0)
    tl.store(out_ptr + request * stride_out_request + head * stride_out_head + index,
             importance, mask=valid)


def batched_candidate_importance(query: torch.Tensor, key: torch.Tensor,
                                 rows: list[torch.Tensor | None], scale: float,
                                 pool_kernels: list[int]) -> list[torch.Tensor | None]:
    """See ``importance.batched_candidate_importance``."""
    counts = [0 if r is None else r.numel() for r in rows]
    if not any(counts):
        return [None] * len(rows)
    device, num_heads, head_size = query.device, query.shape[1], query.shape[2]
    block_n = max(triton.next_power_of_2(max(counts)), 16)  # tl.dot needs >= 16
    padded = torch.zeros(len(rows), block_n, dtype=torch.int64, device=device)
    for i, r in enumerate(rows):
        if counts[i]:
            padded[i, :counts[i]] = r
    out = torch.zeros(len(rows), num_heads, block_n, dtype=torch.float32, device=device)
    max_half = max(pool_kernels) // 2
    assert query.stride(2) == 1 and key.stride(2) == 1
    _importance_kernel[(len(rows), num_heads)](
        query, key, padded, torch.tensor(counts, device=device),
        torch.tensor(pool_kernels, device=device), out,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        padded.stride(0), out.stride(0), out.stride(1),
        scale, num_heads // key.shape[1], head_size,
        BLOCK_N=block_n, BLOCK_D=max(triton.next_power_of_2(head_size), 16),
        MAX_HALF=max_half)
    totals = out.sum(dim=1)
    return [None if n == 0 else totals[i, :n] for i, n in enumerate(counts)]
