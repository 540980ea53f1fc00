"""Triton kernel for block-causal attention over a paged KV cache (CUDA).

Same signature and semantics as ``block_attention.block_causal_attention``; tests compare
the two on a named grid of shapes (on CPU through ``TRITON_INTERPRET=1``). One program per
(query row, head) streams the visible keys of its request page by page with an online
softmax; the KV cache may have any strides (vLLM's layouts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def accumulate_tile(query, kv_ptr, page, slot, key_ok, kv_head, dims, dim_ok, stride_kv_page,
                    stride_kv_head, stride_kv_slot, stride_kv_c, head_size, scale,
                    running_max, running_sum, acc):
    """One tile of keys (``page``/``slot`` per key, ``key_ok`` where visible) folded into
    the online softmax state (running max, running sum, weighted values)."""
    base = page * stride_kv_page + kv_head * stride_kv_head + slot * stride_kv_slot
    tile_mask = key_ok[:, None] & dim_ok[None, :]
    keys = tl.load(kv_ptr + base[:, None] + dims[None, :] * stride_kv_c,
                   mask=tile_mask, other=0.0).to(tl.float32)
    values = tl.load(kv_ptr + base[:, None] + (dims[None, :] + head_size) * stride_kv_c,
                     mask=tile_mask, other=0.0).to(tl.float32)
    scores = tl.sum(keys * query[None, :], axis=1) * scale
    scores = tl.where(key_ok, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=0))
    # A tile with no visible key leaves the state unchanged (and avoids -inf - -inf).
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    weights = tl.exp(scores - safe_max)
    correction = tl.exp(running_max - safe_max)
    running_sum = running_sum * correction + tl.sum(weights, axis=0)
    acc = acc * correction + tl.sum(weights[:, None] * values, axis=0)
    return new_max, running_sum, acc


@triton.jit
def accumulate_key_range(query, kv_ptr, table, first, end, kv_head, dims, dim_ok,
                         stride_kv_page, stride_kv_head, stride_kv_slot, stride_kv_c,
                         head_size, scale, page_size, running_max, running_sum, acc,
                         BLOCK_N: tl.constexpr):
    """Keys at positions [first, end) of a request (``table``: its page ids) folded into
    the online softmax state, BLOCK_N at a time."""
    for start in range(first, end, BLOCK_N):
        key_positions = start + tl.arange(0, BLOCK_N)
        key_ok = key_positions < end
        page = tl.load(table + key_positions // page_size, mask=key_ok, other=0)
        running_max, running_sum, acc = accumulate_tile(
            query, kv_ptr, page, key_positions % page_size, key_ok, kv_head, dims, dim_ok,
            stride_kv_page, stride_kv_head, stride_kv_slot, stride_kv_c, head_size, scale,
            running_max, running_sum, acc)
    return running_max, running_sum, acc


@triton.jit
def _block_causal_attention_kernel(
    query_ptr, kv_ptr, out_ptr, query_positions_ptr, row_request_ptr, kv_lens_ptr,
    block_table_ptr,
    stride_q_row, stride_q_head, stride_kv_page, stride_kv_head, stride_kv_slot, stride_kv_c,
    stride_o_row, stride_o_head, stride_table_row,
    scale, diffusion_block_size, page_size, group_size, head_size,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    request = tl.load(row_request_ptr + row)
    position = tl.load(query_positions_ptr + row)
    kv_len = tl.load(kv_lens_ptr + request)
    # Keys of the query's own diffusion block and all earlier ones, within kv_len.
    visible = tl.minimum(kv_len, (position // diffusion_block_size + 1) * diffusion_block_size)
    kv_head = head // group_size

    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_size
    query = tl.load(query_ptr + row * stride_q_row + head * stride_q_head + dims,
                    mask=dim_ok, other=0.0).to(tl.float32)

    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.full((), 0.0, tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    running_max, running_sum, acc = accumulate_key_range(
        query, kv_ptr, block_table_ptr + request * stride_table_row, 0, visible, kv_head,
        dims, dim_ok, stride_kv_page, stride_kv_head, stride_kv_slot, stride_kv_c, head_size,
        scale, page_size, running_max, running_sum, acc, BLOCK_N)
    out = acc / running_sum
    tl.store(out_ptr + row * stride_o_row + head * stride_o_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def block_causal_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                           query_positions: torch.Tensor, query_start_loc: list[int],
                           kv_lens: list[int], block_table: torch.Tensor,
                           diffusion_block_size: int, scale: float) -> torch.Tensor:
    """See ``block_attention.block_causal_attention``; shapes and semantics are identical."""
    num_rows, num_heads, head_size = query.shape
    output = torch.empty_like(query)
    if num_rows == 0:
        return output
    counts = torch.tensor([b - a for a, b in zip(query_start_loc[:-1], query_start_loc[1:])])
    row_request = torch.repeat_interleave(torch.arange(len(kv_lens)), counts)
    device = query.device
    assert query.stride(2) == 1 and output.stride(2) == 1
    table = block_table.to(device=device, dtype=torch.int64).contiguous()
    _block_causal_attention_kernel[(num_rows, num_heads)](
        query, kv_cache, output, query_positions.to(device=device, dtype=torch.int64),
        row_request.to(device), torch.tensor(kv_lens, device=device, dtype=torch.int64),
        table, query.stride(0), query.stride(1), *kv_cache.stride(), output.stride(0),
        output.stride(1), table.stride(0),
        scale, diffusion_block_size, kv_cache.shape[2], num_heads // kv_cache.shape[1],
        head_size, BLOCK_D=triton.next_power_of_2(head_size), BLOCK_N=32,
    )
    return output
