"""Triton kernel for ``sparse_prefix.sparse_prefix_attention`` (CUDA; same signature and
semantics). One program per (tile of one request's rows, head) streams the kept positions
of its KV head (each key's page looked up), then its block's keys, with one online softmax
(``triton_block_attention``'s tiles and products).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_diffusion.kernels.triton_block_attention import (accumulate_key_range,
                                                             accumulate_tile, launch_shape,
                                                             load_query_tile, plan_tiles,
                                                             store_rows)


@triton.jit
def _sparse_prefix_attention_kernel(
    query_ptr, kv_ptr, out_ptr, query_positions_ptr, tiles_ptr, num_tiles, prefix_lens_ptr,
    block_table_ptr, kept_ptr,
    stride_q_row, stride_q_head, stride_kv_page, stride_kv_head, stride_kv_slot, stride_kv_c,
    stride_o_row, stride_o_head, stride_table_row, stride_kept_request, stride_kept_head,
    num_kept, scale, diffusion_block_size, page_size, group_size, head_size,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    FP32_PRODUCTS: tl.constexpr, FP32_PRECISION: tl.constexpr,
):
    head = tl.program_id(1)
    request, kv_len, rows, row_ok, positions, dims, dim_ok, query = load_query_tile(
        query_ptr, tiles_ptr, num_tiles, query_positions_ptr, stride_q_row, stride_q_head,
        head, head_size, BLOCK_M, BLOCK_D)
    prefix_len = tl.load(prefix_lens_ptr + request)
    kv_head = head // group_size
    running_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    table = block_table_ptr + request * stride_table_row
    kept_row = kept_ptr + request * stride_kept_request + kv_head * stride_kept_head
    # The kept prefix positions (every row of the tile sees all of them).
    for start in range(0, num_kept, BLOCK_N):
        offsets = start + tl.arange(0, BLOCK_N)
        index = tl.load(kept_row + offsets, mask=offsets < num_kept, other=-1)
        key_in = index >= 0
        safe = tl.where(key_in, index, 0)
        page = tl.load(table + safe // page_size, mask=key_in, other=0)
        visible = row_ok[:, None] & key_in[None, :]
        running_max, running_sum, acc = accumulate_tile(
            query, kv_ptr, page, safe % page_size, key_in, visible, kv_head, dims, dim_ok,
            stride_kv_page, stride_kv_head, stride_kv_slot, stride_kv_c, head_size, scale,
            running_max, running_sum, acc, FP32_PRODUCTS, FP32_PRECISION)
    # The block's keys up to the end of each row's own diffusion block.
    row_end = tl.minimum(kv_len, (positions // diffusion_block_size + 1) * diffusion_block_size)
    row_end = tl.where(row_ok, row_end, 0)
    running_max, running_sum, acc = accumulate_key_range(
        query, kv_ptr, table, prefix_len, tl.max(row_end, 0), row_end, kv_head, dims,
        dim_ok, stride_kv_page, stride_kv_head, stride_kv_slot, stride_kv_c, head_size,
        scale, page_size, running_max, running_sum, acc, BLOCK_N, FP32_PRODUCTS,
        FP32_PRECISION)
    store_rows(out_ptr, rows, row_ok, head, dims, dim_ok, stride_o_row, stride_o_head,
               running_sum, acc)


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
    assert query.stride(2) == 1 and output.stride(2) == 1
    tiles, num_tiles, block_m = plan_tiles(query_start_loc, kv_lens, device,
                                            query.dtype)
    table = block_table.to(device=device, dtype=torch.int64).contiguous()
    kept = kept_index.to(device=device, dtype=torch.int64).contiguous()
    _sparse_prefix_attention_kernel[(num_tiles, num_heads)](
        query, kv_cache, output, query_positions.to(device=device, dtype=torch.int64),
        tiles, num_tiles, torch.tensor(prefix_lens, device=device, dtype=torch.int64),
        table, kept, query.stride(0), query.stride(1), *kv_cache.stride(), output.stride(0),
        output.stride(1), table.stride(0), kept.stride(0), kept.stride(1), kept.shape[2],
        scale, diffusion_block_size, kv_cache.shape[2], num_heads // kv_cache.shape[1],
        head_size, BLOCK_M=block_m, **launch_shape(query, head_size),
    )
    return output
