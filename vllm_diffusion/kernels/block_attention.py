"""Block-causal attention over a paged KV cache: the plain PyTorch reference and the
padded torch path (docs/kernels.md, "The ops"). One layer's cache: kv_cache [num_pages,
num_kv_heads, page_size, 2 * head_size], read through ``kv_pages.key_value_views``; a
query at position q sees key k iff ``k < kv_len`` and ``k // B <= q // B``.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_diffusion.kernels.kv_pages import key_value_views


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store key/value rows at their slots (``slot = page * page_size + offset``).

    key, value:   [T, num_kv_heads, head_size]
    slot_mapping: [T] int64; a negative slot means "do not store this row".
    """
    page_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    pages, offsets = slots // page_size, slots % page_size
    keys, values = key_value_views(kv_cache)
    # Advanced indices around a slice put the indexed dim first: [n, num_kv_heads, D].
    keys[pages, :, offsets] = key[keep].to(kv_cache.dtype)
    values[pages, :, offsets] = value[keep].to(kv_cache.dtype)


def gather_kv(kv_cache: torch.Tensor, page_ids: torch.Tensor,
              length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions [0, length) of one request: two [length, H_kv, D]."""
    page_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[1]
    num_pages = -(-length // page_size)
    pages = page_ids[:num_pages]
    return tuple(view[pages].permute(0, 2, 1, 3).reshape(  # [n_pages, H_kv, page, D] ->
        num_pages * page_size, num_kv_heads, -1)[:length]  # [length, H_kv, D]
        for view in key_value_views(kv_cache))


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


# Query runs longer than this (prompt prefill chunks) are attended one request per call
LONG_QUERY_RUN = 64


@dataclasses.dataclass
class PaddedRun:
    """The rows of one padded attention call and what it needs besides a layer's tensors."""

    rows: torch.Tensor | None  # [n] the step rows it attends (None: all, in order)
    key_pages: torch.Tensor  # [R, K] page of each key position
    key_offsets: torch.Tensor  # [1, K] its offset in the page
    # [n] request and slot of each row in [R, Q]; None: every request has Q rows
    request_of_row: torch.Tensor | None
    slot_of_row: torch.Tensor | None
    mask: torch.Tensor  # [R, 1, G * Q, K] bool, the query heads of a KV head stacked
    shape: tuple[int, int, int, int]  # R, Q, K, G


@dataclasses.dataclass
class PaddedPlan:
    """The step-fixed part of ``padded_block_causal_attention`` (``plan_padded_attention``),
    applied per layer by ``attend_padded``."""

    runs: list[PaddedRun]
    num_rows: int


def padded_block_causal_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                                  query_positions: torch.Tensor, query_start_loc: list[int],
                                  kv_lens: list[int], block_table: torch.Tensor,
                                  diffusion_block_size: int, scale: float) -> torch.Tensor:
    """``block_causal_attention`` vectorised over requests: short query runs padded to the
    longest into one call ([R, H_kv, group * max_queries, max_keys]), each run over
    ``LONG_QUERY_RUN`` rows in its own; ``plan_padded_attention`` is its step-fixed part."""
    plan = plan_padded_attention(query_positions, query_start_loc, kv_lens, block_table,
                                 diffusion_block_size, kv_cache.shape[2],
                                 query.shape[1] // kv_cache.shape[1])
    return attend_padded(query, kv_cache, plan, scale)


def plan_padded_attention(query_positions: torch.Tensor, query_start_loc: list[int],
                          kv_lens: list[int], block_table: torch.Tensor,
                          diffusion_block_size: int, page_size: int,
                          group: int) -> PaddedPlan:
    """The padded calls of a step's rows (``group``: query heads per KV head)."""
    counts = [b - a for a, b in zip(query_start_loc[:-1], query_start_loc[1:])]
    num_rows = query_start_loc[-1]
    long_runs = [r for r, n in enumerate(counts) if n > LONG_QUERY_RUN]
    if not long_runs or len(long_runs) == len(counts) == 1:
        return PaddedPlan([_plan_run(None, query_positions, counts, kv_lens, block_table,
                                     diffusion_block_size, page_size, group)], num_rows)
    short_runs = [r for r, n in enumerate(counts) if n <= LONG_QUERY_RUN]
    runs = []
    for requests in [[r] for r in long_runs] + ([short_runs] if short_runs else []):
        rows = torch.cat([torch.arange(query_start_loc[r], query_start_loc[r + 1])
                          for r in requests]).to(query_positions.device)
        runs.append(_plan_run(
            rows, query_positions[rows], [counts[r] for r in requests],
            [kv_lens[r] for r in requests],
            block_table[torch.tensor(requests, device=block_table.device)],
            diffusion_block_size, page_size, group))
    return PaddedPlan(runs, num_rows)


def _plan_run(rows: torch.Tensor | None, query_positions: torch.Tensor, counts: list[int],
              kv_lens: list[int], block_table: torch.Tensor, diffusion_block_size: int,
              page_size: int, group: int) -> PaddedRun:
    device = query_positions.device
    num_requests = len(kv_lens)
    max_queries, max_keys = max(counts), max(kv_lens)
    # Key positions of every request: [R, max_keys] -> pages and offsets in the cache.
    key_positions = torch.arange(max_keys, device=device)
    pages = block_table[:, :(max_keys + page_size - 1) // page_size].to(device)
    key_pages = pages[:, key_positions // page_size]  # [R, max_keys]
    if all(n == max_queries for n in counts):  # no padding: rows are [R, Q] already
        request_of_row = slot_of_row = None
        row_block = (query_positions.to(device) // diffusion_block_size).view(
            num_requests, max_queries)
    else:
        request_of_row = torch.repeat_interleave(
            torch.arange(num_requests, device=device), torch.tensor(counts, device=device))
        starts = torch.tensor([0, *counts], device=device).cumsum(0)[:-1]
        slot_of_row = torch.arange(len(request_of_row), device=device) - starts[request_of_row]
        row_block = torch.full((num_requests, max_queries), -1, dtype=torch.long,
                               device=device)
        row_block[request_of_row, slot_of_row] = (query_positions.to(device)
                                                  // diffusion_block_size)
    lens = torch.tensor(kv_lens, device=device)
    visible = ((key_positions[None, None, :] // diffusion_block_size <= row_block[:, :, None])
               & (key_positions[None, None, :] < lens[:, None, None]))  # [R, Q, K]
    visible |= (row_block < 0)[:, :, None]  # padding rows: attend to anything (discarded)
    mask = visible[:, None, None].expand(-1, -1, group, -1, -1).reshape(
        num_requests, 1, group * max_queries, max_keys)
    return PaddedRun(rows, key_pages, (key_positions % page_size)[None, :], request_of_row,
                     slot_of_row, mask, (num_requests, max_queries, max_keys, group))


def attend_padded(query: torch.Tensor, kv_cache: torch.Tensor, plan: PaddedPlan,
                  scale: float, output: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's attention of the planned rows. query: [T, H, D]; returns [T, H, D],
    written into ``output`` where given."""
    if len(plan.runs) == 1 and plan.runs[0].rows is None and plan.num_rows:
        attended = _attend_run(query, kv_cache, plan.runs[0], scale)  # one run: all rows
        return attended if output is None else output.copy_(attended)
    if output is None:
        output = torch.empty_like(query)
    if plan.num_rows == 0:
        return output
    for run in plan.runs:
        output[run.rows] = _attend_run(query[run.rows], kv_cache, run, scale)
    return output


def _attend_run(query: torch.Tensor, kv_cache: torch.Tensor, run: PaddedRun,
                scale: float) -> torch.Tensor:
    num_requests, max_queries, _, _ = run.shape
    num_rows, num_heads, head_size = query.shape
    # [R, max_keys, H_kv, D] -> [R, H_kv, max_keys, D]
    keys, values = (view[run.key_pages, :, run.key_offsets].permute(0, 2, 1, 3).to(query.dtype)
                    for view in key_value_views(kv_cache))
    if run.request_of_row is None:
        padded_query = query.view(num_requests, max_queries, num_heads, head_size)
    else:
        padded_query = query.new_zeros(num_requests, max_queries, num_heads, head_size)
        padded_query[run.request_of_row, run.slot_of_row] = query
    out = grouped_attention(padded_query, keys, values, run.mask, scale)  # [R, Q, H, D]
    if run.request_of_row is None:
        return out.reshape(num_rows, num_heads, head_size)
    return out[run.request_of_row, run.slot_of_row]


def grouped_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Scaled-dot-product attention of query [*, Q, H, D] over keys and values
    [*, H_kv, K, D], the query heads of each KV head side by side ([*, H_kv, G * Q, D], as
    ``mask``'s rows are); returns [*, Q, H, D]."""
    *lead, rows, num_heads, head_size = query.shape
    num_kv_heads = keys.shape[-3]
    group = num_heads // num_kv_heads
    grouped = query.reshape(*lead, rows, num_kv_heads, group, head_size).movedim(-4, -2)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped.reshape(*lead, num_kv_heads, group * rows, head_size), keys, values,
        attn_mask=mask, scale=scale)
    return out.view(*lead, num_kv_heads, group, rows, head_size).movedim(-2, -4).reshape(
        *lead, rows, num_heads, head_size)
