"""Triton kernel for prefix-sparse attention over a paged KV cache (CUDA).

Same signature and semantics as ``sparse_prefix.sparse_prefix_attention``; tests compare
the two on a named grid of shapes (on CPU through ``TRITON_INTERPRET=1``). One program per
(query row, head) streams first the kept prefix positions of its KV head (an index list,
so each key's page is looked up), then its block's keys, with one online softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_diffusion.kernels.triton_block_attention import (accumulate_key_range,
                                                             accumulate_tile)


@triton.jit
def _sparse_prefix_attention_kernel(
    query_ptr, kv_ptr, out_ptr, query_positions_ptr, row_request_ptr, kv_lens_ptr,
    prefix_lens_ptr, block_table_ptr, kept_ptr,
    stride_q_row, stride_q_head, stride_kv_page, stride_kv_head, stride_kv_slot, stride_kv_c,
    stride_o_row, stride_o_head, stride_table_row, stride_kept_request, stride_kept_head,
    num_kept, scale, diffusion_block_size, page_size, group_size, head_size,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    request = tl.load(row_request_ptr + row)
    position = tl.load(query_positions_ptr + row)
    kv_len = tl.load(kv_lens_ptr + request)
    prefix_len = tl.load(prefix_lens_ptr + request)
    kv_head = head // group_size
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_size
    query = tl.load(query_ptr + row * stride_q_row + head * stride_q_head + dims,
                    mask=dim_ok, other=0.0).to(tl.float32)
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.full((), 0.0, tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    table = block_table_ptr + request * stride_table_row
    kept_row = kept_ptr + request * stride_kept_request + kv_head * stride_kept_head
    for start in range(0, num_kept, BLOCK_N):
        offsets = start + tl.arange(0, BLOCK_N)
        index = tl.load(kept_row + offsets, mask=offsets < num_kept, other=-1)
        key_ok = index >= 0
        safe = tl.where(key_ok, index, 0)
        page = tl.load(table + safe // page_size, mask=key_ok, other=0)
        running_max, running_sum, acc = accumulate_tile(
            query, kv_ptr, page, safe % page_size, key_ok, kv_head, dims, dim_ok,
            stride_kv_page, stride_kv_head, stride_kv_slot, stride_kv_c, head_size, scale,
            running_max, running_sum, acc)
    # The block's keys up to the end of the query's own diffusion block.
    visible = tl.minimum(kv_len, (position // diffusion_block_size + 1) * diffusion_block_size)
    running_max, running_sum, acc = accumulate_key_range(
        query, kv_ptr, table, prefix_len, visible, kv_head, dims, dim_ok, stride_kv_page,
        stride_kv_head, stride_kv_slot, stride_kv_c, head_size, scale, page_size,
        running_max, running_sum, acc, BLOCK_N)
    out = acc / running_sum
    tl.store(out_ptr + row * stride_o_row + head * stride_o_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def sparse_prefix_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                            query_positions: torch.Tensor, query_start_loc: list[int],
                            kv_lens: list[int], block_table: torch.Tensor,
                            diffusion_block_size: int, scale: float,
                            kept_index: torch.Tensor, prefix_lens: list[int],
                            kept_kv: list | None = None) -> torch.Tensor:
    """See ``sparse_prefix.sparse_prefix_attention``; shapes and semantics are identical
    (``kept_kv`` is ignored: each call reads the kept positions' pages directly)."""
    num_rows, num_heads, head_size = query.shape
    output = torch.empty_like(query)
    if num_rows == 0:
        return output
    device = query.device
    counts = torch.tensor([b - a for a, b in zip(query_start_loc[:-1], query_start_loc[1:])])
    row_request = torch.repeat_interleave(torch.arange(len(kv_lens)), counts).to(device)
    assert query.stride(2) == 1 and output.stride(2) == 1
    table = block_table.to(device=device, dtype=torch.int64).contiguous()
    kept = kept_index.to(device=device, dtype=torch.int64).contiguous()
    _sparse_prefix_attention_kernel[(num_rows, num_heads)](
        query, kv_cache, output, query_positions.to(device=device, dtype=torch.int64),
        row_request, torch.tensor(kv_lens, device=device, dtype=torch.int64),
        torch.tensor(prefix_lens, device=device, dtype=torch.int64), table, kept,
        query.stride(0), query.stride(1), *kv_cache.stride(), output.stride(0),
        output.stride(1), table.stride(0), kept.stride(0), kept.stride(1), kept.shape[2],
        scale, diffusion_block_size, kv_cache.shape[2], num_heads // kv_cache.shape[1],
        head_size, BLOCK_D=triton.next_power_of_2(head_size), BLOCK_N=32,
    )
    return output
