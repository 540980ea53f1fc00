"""Block-causal attention over a paged KV cache: plain PyTorch reference implementation.

Layout of one layer's cache (vLLM's logical per-layer view):
    kv_cache: [num_pages, num_kv_heads, page_size, 2 * head_size]   keys in [..., :D], values in [..., D:]

Rule (SDAR, aligned to absolute position 0): a query at position q attends to the key at
position k iff ``k < kv_len`` of its request and ``k // B <= q // B`` (bidirectional inside
a diffusion block of size B, causal across blocks). Requests are ragged: each brings its
own number of query positions, at arbitrary positions. (Attention over a selection of the
prefix keys is ``sparse_prefix``.)

A Triton kernel for CUDA must keep these signatures; tests compare it with these functions.
"""

from __future__ import annotations

import torch


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store key/value rows at their slots (``slot = page * page_size + offset``).

    key, value:   [T, num_kv_heads, head_size]
    slot_mapping: [T] int64; a negative slot means "do not store this row".
    """
    head_size = key.shape[-1]
    page_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    pages, offsets = slots // page_size, slots % page_size
    # Advanced indices around a slice put the indexed dim first: [n, num_kv_heads, C].
    kv_cache[pages, :, offsets, :head_size] = key[keep].to(kv_cache.dtype)
    kv_cache[pages, :, offsets, head_size:] = value[keep].to(kv_cache.dtype)


def gather_kv(kv_cache: torch.Tensor, page_ids: torch.Tensor,
              length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions [0, length) of one request: two [length, H_kv, D]."""
    page_size = kv_cache.shape[2]
    head_size = kv_cache.shape[3] // 2
    num_pages = -(-length // page_size)
    pages = kv_cache[page_ids[:num_pages]]  # [n_pages, H_kv, page, 2D]
    flat = pages.permute(0, 2, 1, 3).reshape(num_pages * page_size, pages.shape[1], -1)
    flat = flat[:length]
    return flat[..., :head_size], flat[..., head_size:]


def block_causal_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                           query_positions: torch.Tensor, query_start_loc: list[int],
                           kv_lens: list[int], block_table: torch.Tensor,
                           diffusion_block_size: int, scale: float) -> torch.Tensor:
    """Attention of ragged query rows over each request's paged keys/values.

    query:           [T, num_heads, head_size]
    query_positions: [T] absolute position of each query row
    query_start_loc: R + 1 offsets of each request's rows in ``query``
    kv_lens:         R key counts: request r attends to key positions [0, kv_lens[r])
    block_table:     [R, max_pages] page ids of each request
    Returns [T, num_heads, head_size].
    """
    num_heads = query.shape[1]
    output = torch.empty_like(query)
    for r in range(len(kv_lens)):
        start, end = query_start_loc[r], query_start_loc[r + 1]
        if start == end:
            continue
        keys, values = gather_kv(kv_cache, block_table[r], kv_lens[r])
        group = num_heads // keys.shape[1]
        keys = keys.to(query.dtype).repeat_interleave(group, dim=1)  # [L, H, D]
        values = values.to(query.dtype).repeat_interleave(group, dim=1)
        q_block = query_positions[start:end, None] // diffusion_block_size
        k_block = torch.arange(kv_lens[r], device=query.device) // diffusion_block_size
        visible = k_block[None, :] <= q_block  # [n, L]
        out = torch.nn.functional.scaled_dot_product_attention(
            query[start:end].transpose(0, 1), keys.transpose(0, 1),
            values.transpose(0, 1), attn_mask=visible, scale=scale)
        output[start:end] = out.transpose(0, 1)
    return output


# Query runs longer than this (prompt prefill chunks) are attended one request per call,
# so that the other requests' short runs are not padded to their length.
LONG_QUERY_RUN = 64


def padded_block_causal_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                                  query_positions: torch.Tensor, query_start_loc: list[int],
                                  kv_lens: list[int], block_table: torch.Tensor,
                                  diffusion_block_size: int, scale: float) -> torch.Tensor:
    """``block_causal_attention`` vectorised over requests (the CPU fast path).

    Requests with short query runs are padded to the longest of them and attended in one
    scaled-dot-product call, the query heads of each KV head stacked so that keys and
    values are gathered once per KV head ([R, H_kv, group * max_queries, max_keys]); each
    request with a long run (over ``LONG_QUERY_RUN`` rows) is attended in its own call.
    """
    counts = [b - a for a, b in zip(query_start_loc[:-1], query_start_loc[1:])]
    long_runs = [r for r, n in enumerate(counts) if n > LONG_QUERY_RUN]
    if not long_runs or len(long_runs) == len(counts) == 1:
        return _padded_attention(query, kv_cache, query_positions, query_start_loc, kv_lens,
                                 block_table, diffusion_block_size, scale)
    short_runs = [r for r, n in enumerate(counts) if n <= LONG_QUERY_RUN]
    output = torch.empty_like(query)
    for group in [[r] for r in long_runs] + ([short_runs] if short_runs else []):
        rows = torch.cat([torch.arange(query_start_loc[r], query_start_loc[r + 1])
                          for r in group]).to(query.device)
        loc = [0]
        for r in group:
            loc.append(loc[-1] + counts[r])
        output[rows] = _padded_attention(
            query[rows], kv_cache, query_positions[rows], loc, [kv_lens[r] for r in group],
            block_table[torch.tensor(group, device=block_table.device)],
            diffusion_block_size, scale)
    return output


def _padded_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                      query_positions: torch.Tensor, query_start_loc: list[int],
                      kv_lens: list[int], block_table: torch.Tensor,
                      diffusion_block_size: int, scale: float) -> torch.Tensor:
    num_requests = len(kv_lens)
    num_rows, num_heads, head_size = query.shape
    if num_rows == 0:
        return torch.empty_like(query)
    device = query.device
    page_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[1]
    counts = torch.tensor([b - a for a, b in zip(query_start_loc[:-1], query_start_loc[1:])],
                          device=device)
    max_queries, max_keys = int(counts.max()), max(kv_lens)
    # Key positions of every request: [R, max_keys] -> pages and offsets in the cache.
    key_positions = torch.arange(max_keys, device=device)
    pages = block_table[:, :(max_keys + page_size - 1) // page_size].to(device)
    key_pages = pages[:, key_positions // page_size]  # [R, max_keys]
    kv = kv_cache[key_pages, :, (key_positions % page_size)[None, :]]  # [R, max_keys, H_kv, 2D]
    kv = kv.permute(0, 2, 1, 3).to(query.dtype)  # [R, H_kv, max_keys, 2D]
    keys, values = kv[..., :head_size], kv[..., head_size:]
    group = num_heads // num_kv_heads
    # Scatter the ragged query rows into [R, max_queries]; the query heads sharing a KV
    # head side by side, so keys and values are not repeated per query head:
    # [R, H_kv, group * max_queries, D].
    request_of_row = torch.repeat_interleave(torch.arange(num_requests, device=device), counts)
    starts = torch.tensor(query_start_loc[:-1], device=device)
    slot_of_row = torch.arange(num_rows, device=device) - starts[request_of_row]
    padded_query = query.new_zeros(num_requests, max_queries, num_heads, head_size)
    padded_query[request_of_row, slot_of_row] = query
    grouped_query = padded_query.view(num_requests, max_queries, num_kv_heads, group,
                                      head_size).permute(0, 2, 3, 1, 4).reshape(
        num_requests, num_kv_heads, group * max_queries, head_size)
    row_block = torch.full((num_requests, max_queries), -1, dtype=torch.long, device=device)
    row_block[request_of_row, slot_of_row] = query_positions.to(device) // diffusion_block_size
    lens = torch.tensor(kv_lens, device=device)
    visible = ((key_positions[None, None, :] // diffusion_block_size <= row_block[:, :, None])
               & (key_positions[None, None, :] < lens[:, None, None]))  # [R, Q, K]
    visible |= (row_block < 0)[:, :, None]  # padding rows: attend to anything (discarded)
    mask = visible[:, None, None].expand(-1, -1, group, -1, -1).reshape(
        num_requests, 1, group * max_queries, max_keys)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped_query, keys, values, attn_mask=mask, scale=scale)  # [R, H_kv, G * Q, D]
    out = out.view(num_requests, num_kv_heads, group, max_queries, head_size).permute(
        0, 3, 1, 2, 4).reshape(num_requests, max_queries, num_heads, head_size)
    return out[request_of_row, slot_of_row]
