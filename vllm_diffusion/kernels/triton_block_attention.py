"""Triton kernel for ``block_attention.block_causal_attention`` (CUDA; same signature and
semantics). One program per (tile of up to ``BLOCK_M`` rows of one request, head) streams
the keys its rows see, ``BLOCK_N`` at a time, with an online softmax and ``tl.dot``
products, each key tile read once per tile; the KV cache may have any strides.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

TILE_FIELDS = 4  # per tile: request, first row, end row, key count of its request


@triton.jit
def accumulate_tile(query, kv_ptr, page, slot, key_in, visible, kv_head, dims, dim_ok,
                    stride_kv_page, stride_kv_head, stride_kv_slot, stride_kv_c, head_size,
                    scale, running_max, running_sum, acc, FP32_PRODUCTS: tl.constexpr,
                    FP32_PRECISION: tl.constexpr):
    """One tile of keys folded into the rows' online softmax state.

    query [BLOCK_M, BLOCK_D] (input dtype); page, slot, key_in [BLOCK_N] (``key_in``: the
    key exists); visible [BLOCK_M, BLOCK_N] (row sees key; implies ``key_in``);
    running_max, running_sum [BLOCK_M] and acc [BLOCK_M, BLOCK_D] in fp32.
    """
    base = page * stride_kv_page + kv_head * stride_kv_head + slot * stride_kv_slot  # [N]
    keys_t = tl.load(kv_ptr + base[None, :] + dims[:, None] * stride_kv_c,  # [D, N]
                     mask=dim_ok[:, None] & key_in[None, :], other=0.0).to(query.dtype)
    values = tl.load(kv_ptr + base[:, None] + (dims[None, :] + head_size) * stride_kv_c,
                     mask=key_in[:, None] & dim_ok[None, :], other=0.0).to(query.dtype)
    if FP32_PRODUCTS:
        scores = tl.dot(query.to(tl.float32), keys_t.to(tl.float32),
                        input_precision=FP32_PRECISION)
    else:
        scores = tl.dot(query, keys_t)
    scores = tl.where(visible, scores * scale, float("-inf"))  # [M, N] fp32
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    # A row with no visible key yet keeps its state (and avoids -inf - -inf).
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    weights = tl.exp(scores - safe_max[:, None])
    correction = tl.exp(running_max - safe_max)
    running_sum = running_sum * correction + tl.sum(weights, axis=1)
    if FP32_PRODUCTS:
        update = tl.dot(weights, values.to(tl.float32), input_precision=FP32_PRECISION)
    else:
        update = tl.dot(weights.to(values.dtype), values)
    acc = acc * correction[:, None] + update
    return new_max, running_sum, acc


@triton.jit
def accumulate_key_range(query, kv_ptr, table, first, end, row_end, kv_head, dims, dim_ok,
                         stride_kv_page, stride_kv_head, stride_kv_slot, stride_kv_c,
                         head_size, scale, page_size, running_max, running_sum, acc,
                         BLOCK_N: tl.constexpr, FP32_PRODUCTS: tl.constexpr,
                         FP32_PRECISION: tl.constexpr):
    """Keys at positions [first, end) of a request (``table``: its page ids) folded into
    the rows' state; row i sees the keys before ``row_end[i]`` ([BLOCK_M], at most end)."""
    for start in range(first, end, BLOCK_N):
        key_positions = start + tl.arange(0, BLOCK_N)
        key_in = key_positions < end
        page = tl.load(table + key_positions // page_size, mask=key_in, other=0)
        visible = key_positions[None, :] < row_end[:, None]
        running_max, running_sum, acc = accumulate_tile(
            query, kv_ptr, page, key_positions % page_size, key_in, visible, kv_head, dims,
            dim_ok, stride_kv_page, stride_kv_head, stride_kv_slot, stride_kv_c, head_size,
            scale, running_max, running_sum, acc, FP32_PRODUCTS, FP32_PRECISION)
    return running_max, running_sum, acc


@triton.jit
def load_query_tile(query_ptr, tiles_ptr, num_tiles, query_positions_ptr, stride_q_row,
                    stride_q_head, head, head_size, BLOCK_M: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """This program's tile: its request, rows, their positions and queries."""
    tile = tl.program_id(0)
    request = tl.load(tiles_ptr + tile)
    first_row = tl.load(tiles_ptr + num_tiles + tile)
    end_row = tl.load(tiles_ptr + 2 * num_tiles + tile)
    kv_len = tl.load(tiles_ptr + 3 * num_tiles + tile)
    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < end_row
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_size
    positions = tl.load(query_positions_ptr + rows, mask=row_ok, other=0)
    query = tl.load(query_ptr + rows[:, None] * stride_q_row + head * stride_q_head
                    + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    return request, kv_len, rows, row_ok, positions, dims, dim_ok, query


@triton.jit
def store_rows(out_ptr, rows, row_ok, head, dims, dim_ok, stride_o_row, stride_o_head,
               running_sum, acc):
    out = acc / running_sum[:, None]
    tl.store(out_ptr + rows[:, None] * stride_o_row + head * stride_o_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _block_causal_attention_kernel(
    query_ptr, kv_ptr, out_ptr, query_positions_ptr, tiles_ptr, num_tiles, block_table_ptr,
    stride_q_row, stride_q_head, stride_kv_page, stride_kv_head, stride_kv_slot, stride_kv_c,
    stride_o_row, stride_o_head, stride_table_row,
    scale, diffusion_block_size, page_size, group_size, head_size,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    FP32_PRODUCTS: tl.constexpr, FP32_PRECISION: tl.constexpr,
):
    head = tl.program_id(1)
    request, kv_len, rows, row_ok, positions, dims, dim_ok, query = load_query_tile(
        query_ptr, tiles_ptr, num_tiles, query_positions_ptr, stride_q_row, stride_q_head,
        head, head_size, BLOCK_M, BLOCK_D)
    # Keys of each row's own diffusion block and all earlier ones, within kv_len.
    row_end = tl.minimum(kv_len, (positions // diffusion_block_size + 1) * diffusion_block_size)
    row_end = tl.where(row_ok, row_end, 0)
    running_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    running_max, running_sum, acc = accumulate_key_range(
        query, kv_ptr, block_table_ptr + request * stride_table_row, 0, tl.max(row_end, 0),
        row_end, head // group_size, dims, dim_ok, stride_kv_page, stride_kv_head,
        stride_kv_slot, stride_kv_c, head_size, scale, page_size, running_max, running_sum,
        acc, BLOCK_N, FP32_PRODUCTS, FP32_PRECISION)
    store_rows(out_ptr, rows, row_ok, head, dims, dim_ok, stride_o_row, stride_o_head,
               running_sum, acc)


def plan_tiles(query_start_loc: list[int], kv_lens: list[int], device: torch.device,
               dtype: torch.dtype) -> tuple[torch.Tensor, int, int]:
    """Each request's rows cut into tiles of BLOCK_M: tiles [TILE_FIELDS, num_tiles] int64
    on ``device`` (request, first row, end row, key count), num_tiles and BLOCK_M (16, 32
    or 64: the smallest holding the longest run, at most 64, and 32 for fp32 inputs, whose
    tiles take twice the registers)."""
    runs = [(r, a, b) for r, (a, b) in enumerate(zip(query_start_loc[:-1],
                                                      query_start_loc[1:])) if b > a]
    longest = max((b - a for _, a, b in runs), default=1)
    block_m = 16 if longest <= 16 else 32 if longest <= 32 or dtype == torch.float32 else 64
    columns = [(r, start, min(start + block_m, b), kv_lens[r])
               for r, a, b in runs for start in range(a, b, block_m)]
    tiles = torch.tensor(list(zip(*columns)), dtype=torch.int64).to(device)
    return tiles.reshape(TILE_FIELDS, -1), len(columns), block_m


def launch_shape(query: torch.Tensor, head_size: int) -> dict:
    """The constexprs every kernel here shares: the padded head size (tl.dot needs 16 or
    more), the key tile, and whether the products run in fp32 and how: ``tf32x3`` for fp32
    inputs natively, ``ieee`` for every dtype under Triton's interpreter, whose ``tl.dot``
    on bf16/fp16 returns garbage (docs/kernels.md)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return {"BLOCK_D": max(16, triton.next_power_of_2(head_size)),
            "BLOCK_N": 64 if head_size <= 64 else 32,
            "FP32_PRODUCTS": query.dtype == torch.float32 or interpreted,
            "FP32_PRECISION": "ieee" if interpreted else "tf32x3"}


def block_causal_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                           query_positions: torch.Tensor, query_start_loc: list[int],
                           kv_lens: list[int], block_table: torch.Tensor,
                           diffusion_block_size: int, scale: float) -> torch.Tensor:
    """See ``block_attention.block_causal_attention``; shapes and semantics are identical."""
    num_rows, num_heads, head_size = query.shape
    output = torch.empty_like(query)
    if num_rows == 0:
        return output
    device = query.device
    assert query.stride(2) == 1 and output.stride(2) == 1
    tiles, num_tiles, block_m = plan_tiles(query_start_loc, kv_lens, device,
                                            query.dtype)
    table = block_table.to(device=device, dtype=torch.int64).contiguous()
    _block_causal_attention_kernel[(num_tiles, num_heads)](
        query, kv_cache, output, query_positions.to(device=device, dtype=torch.int64),
        tiles, num_tiles, table, query.stride(0), query.stride(1), *kv_cache.stride(),
        output.stride(0), output.stride(1), table.stride(0),
        scale, diffusion_block_size, kv_cache.shape[2], num_heads // kv_cache.shape[1],
        head_size, BLOCK_M=block_m, **launch_shape(query, head_size),
    )
    return output
