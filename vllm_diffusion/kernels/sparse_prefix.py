"""Key-sparse attention over a paged KV cache (Sparse-dLLM): the selection of kept context
positions (``select_prefix``), the plain PyTorch reference (``sparse_prefix_attention``)
and the torch paths over each request's kept-key store (``KeptKV``) or without one.
Semantics and the selection rule: docs/kernels.md, "The ops".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from vllm_diffusion.kernels.block_attention import gather_kv, grouped_attention
from vllm_diffusion.kernels.kv_pages import key_value_views


def select_prefix(block_query: torch.Tensor, kv_cache: torch.Tensor, page_ids: torch.Tensor,
                  prefix_len: int, scale: float, keep: int, pool_kernel: int,
                  per_kv_head: bool,
                  sum_heads: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  total_heads: int | None = None,
                  suffix: tuple[int, int] | None = None) -> torch.Tensor:
    """[H_sel, keep] int64 ascending: the context positions kept for one request's block.

    block_query: [n, H, D] the block's queries at this layer; ``suffix``: (block end,
    context end), the positions after the block that have KV (full attention), scored
    after the prefix. ``sum_heads`` adds a score summed over this rank's heads to the other
    ranks' (tensor parallel), ``total_heads`` the heads over all ranks; H_sel is 1, or
    H_kv with ``per_kv_head``.
    """
    positions = torch.arange(prefix_len)  # [N] in scoring order: the prefix, then the suffix
    if suffix is not None and suffix[1] > suffix[0]:
        positions = torch.cat([positions, torch.arange(suffix[0], suffix[1])])
    end = suffix[1] if positions.numel() > prefix_len else prefix_len
    keys, _ = gather_kv(kv_cache, page_ids, end)
    keys = keys[positions.to(keys.device)] if end > prefix_len else keys  # [N, H_kv, D]
    num_heads, num_kv_heads = block_query.shape[1], keys.shape[1]
    mean_query = block_query.float().mean(dim=0)  # [H, D]
    grouped = mean_query.view(num_kv_heads, num_heads // num_kv_heads, -1)  # [H_kv, G, D]
    scores = torch.einsum("kgd,nkd->kgn", grouped, keys.float()) * scale  # [H_kv, G, N]
    if per_kv_head:
        scores = scores.mean(dim=1)  # [H_kv, N]
    else:
        scores = scores.sum(dim=(0, 1))[None]  # [1, N]
        if sum_heads is not None:
            scores = sum_heads(scores)
        scores = scores / (total_heads or num_heads)
    pooled = torch.nn.functional.max_pool1d(
        scores[:, None], pool_kernel, stride=1, padding=pool_kernel // 2)[:, 0, :len(positions)]
    order = torch.sort(pooled, dim=-1, descending=True, stable=True).indices
    return positions.to(order.device)[order[:, :keep]].sort(dim=-1).values


class KeptKV:
    """One request's kept context keys and values at one layer for the current selection
    (the CPU paths' store), None until the first sparse step: the torch path's ``keys``
    and ``values``, [H_kv, K + n, D] each (the K kept positions ascending, then room for
    the n block keys a step writes); vLLM's CPU kernel's ``pages``, a paged cache of the
    request's own, split ([P, H_kv, page_size, 2D]: kept at slots [0, K), block after)."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.kept = 0  # K
        self.pages: torch.Tensor | None = None
        self.plan = None  # vLLM's kernel plan for the store (``SegmentPlan``)
        self.block_slots: torch.Tensor | None = None  # [n] the block keys' slots
        # ([1, n] pages, [1, n] offsets) of the block's keys in the request's pages: the
        # same at every layer and step while the store stands (``StoredRequest.block_kv``)
        self.block_where: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclasses.dataclass
class StoredRequest:
    """One request of a call over kept-key stores: its rows, store, pages and block."""

    index: int
    rows: slice  # its query rows
    store: KeptKV
    table: torch.Tensor  # [max_pages] its pages
    block: int  # its block's key count n
    prefix_len: int

    def kept_kv(self, kept_index: torch.Tensor, views, heads: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Its kept positions' keys and values, [H_kv, K, D] each (``views``: the cache's
        ``key_value_views``; ``heads``: [H_kv, 1] the KV head indices)."""
        kept = kept_index[self.index].to(heads.device)  # [H_kv, K_w], -1 padding at the end
        kept = kept[:, :int((kept[0] >= 0).sum())]  # [H_kv, K]
        page_size = views[0].shape[2]
        pages, offsets = self.table[kept // page_size], kept % page_size
        return views[0][pages, heads, offsets], views[1][pages, heads, offsets]

    def block_kv(self, views, heads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Its block's keys and values as the pages hold them now, [H_kv, n, D] each."""
        store = self.store
        if store.block_where is None or store.block_where[0].shape[1] != self.block:
            positions = torch.arange(self.prefix_len, self.prefix_len + self.block,
                                     device=heads.device)
            page_size = views[0].shape[2]
            store.block_where = (self.table[positions // page_size][None],
                                 (positions % page_size)[None])
        pages, offsets = store.block_where
        return views[0][pages, heads, offsets], views[1][pages, heads, offsets]


def stored_requests(query_start_loc: list[int], kv_lens: list[int],
                    block_table: torch.Tensor, prefix_lens: list[int],
                    kept_kv: list[KeptKV], device: torch.device) -> list[StoredRequest]:
    """The requests of a call over stores that have rows."""
    return [StoredRequest(r, slice(query_start_loc[r], query_start_loc[r + 1]), store,
                          block_table[r].to(device), kv_lens[r] - prefix_lens[r],
                          prefix_lens[r])
            for r, store in enumerate(kept_kv)
            if query_start_loc[r + 1] > query_start_loc[r]]


def sparse_prefix_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                            query_positions: torch.Tensor, query_start_loc: list[int],
                            kv_lens: list[int], block_table: torch.Tensor,
                            diffusion_block_size: int, scale: float,
                            kept_index: torch.Tensor, prefix_lens: list[int],
                            kept_kv: list[KeptKV] | None = None) -> torch.Tensor:
    """Attention of block rows over kept prefix keys plus their block (the reference;
    ``kept_kv`` is ignored).

    query:           [T, H, D], rows of request r at positions >= prefix_lens[r]
    query_positions: [T]; query_start_loc: R + 1 row offsets; kv_lens: R key counts
    block_table:     [R, max_pages]; kept_index: [R, H_kv, K] int64, -1 padding
    Returns [T, H, D].
    """
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[1]
    group = num_heads // num_kv_heads
    output = torch.empty_like(query)
    for r in range(len(kv_lens)):
        start, end = query_start_loc[r], query_start_loc[r + 1]
        if start == end:
            continue
        kept_end = int(kept_index[r].max()) + 1
        keys, values = gather_kv(kv_cache, block_table[r], max(kv_lens[r], kept_end))
        block = torch.arange(prefix_lens[r], kv_lens[r], device=query.device)
        q_block = query_positions[start:end, None] // diffusion_block_size
        for kv_head in range(num_kv_heads):
            kept = kept_index[r, kv_head]
            positions = torch.cat([kept[kept >= 0].to(query.device), block])
            visible = positions[None, :] // diffusion_block_size <= q_block  # [n, K']
            k = keys[positions, kv_head].to(query.dtype)
            v = values[positions, kv_head].to(query.dtype)
            heads = slice(kv_head * group, (kv_head + 1) * group)
            out = torch.nn.functional.scaled_dot_product_attention(
                query[start:end, heads].transpose(0, 1), k[None], v[None],
                attn_mask=visible[None], scale=scale)  # [G, n, D]
            output[start:end, heads] = out.transpose(0, 1)
    return output


def compacted_sparse_prefix_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                                      query_positions: torch.Tensor,
                                      query_start_loc: list[int], kv_lens: list[int],
                                      block_table: torch.Tensor, diffusion_block_size: int,
                                      scale: float, kept_index: torch.Tensor,
                                      prefix_lens: list[int],
                                      kept_kv: list[KeptKV] | None = None) -> torch.Tensor:
    """``sparse_prefix_attention`` over each request's ``KeptKV`` store, filled on its first
    call, the block's keys written after the kept ones at each call (a mask only where the
    rows reach over more than one diffusion block); without stores: gathered."""
    if kept_kv is None:
        return gathered_sparse_prefix_attention(
            query, kv_cache, query_positions, query_start_loc, kv_lens, block_table,
            diffusion_block_size, scale, kept_index, prefix_lens)
    output = torch.empty_like(query)
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[1]
    group = num_heads // num_kv_heads
    views = key_value_views(kv_cache)
    heads = torch.arange(num_kv_heads, device=query.device)[:, None]
    for request in stored_requests(query_start_loc, kv_lens, block_table, prefix_lens,
                                   kept_kv, query.device):
        store, block, r = request.store, request.block, request.index
        start, end = request.rows.start, request.rows.stop
        if store.keys is None or store.keys.shape[1] != store.kept + block:
            kept_keys, kept_values = request.kept_kv(kept_index, views, heads)
            store.kept = kept_keys.shape[1]
            store.keys = query.new_empty(num_kv_heads, store.kept + block, head_size)
            store.values = torch.empty_like(store.keys)
            store.keys[:, :store.kept] = kept_keys
            store.values[:, :store.kept] = kept_values
        block_keys, block_values = request.block_kv(views, heads)  # [H_kv, n, D] each
        store.keys[:, store.kept:] = block_keys
        store.values[:, store.kept:] = block_values
        positions = torch.arange(prefix_lens[r], kv_lens[r], device=query.device)
        rows = end - start
        visible = None  # kept keys precede the rows' block (or share a full-attention span)
        row_blocks = query_positions[start:end].to(query.device) // diffusion_block_size
        if (kv_lens[r] - 1) // diffusion_block_size > int(row_blocks.min()):
            visible = torch.ones(rows, store.kept + block, dtype=torch.bool,
                                 device=query.device)
            visible[:, store.kept:] = (positions[None] // diffusion_block_size
                                       <= row_blocks[:, None])
            visible = visible.repeat(group, 1)  # [G * rows, K + n]
        output[start:end] = grouped_attention(query[start:end], store.keys, store.values,
                                              visible, scale)
    return output


def gathered_sparse_prefix_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                                     query_positions: torch.Tensor, query_start_loc: list[int],
                                     kv_lens: list[int], block_table: torch.Tensor,
                                     diffusion_block_size: int, scale: float,
                                     kept_index: torch.Tensor,
                                     prefix_lens: list[int],
                                     kept_kv: list[KeptKV] | None = None) -> torch.Tensor:
    """``sparse_prefix_attention`` vectorised over requests and KV heads, gathering only
    the kept and block keys every call, [R, H_kv, K + max block keys] (``kept_kv`` is
    ignored)."""
    num_rows, num_heads, head_size = query.shape
    if num_rows == 0:
        return torch.empty_like(query)
    device, num_requests = query.device, len(kv_lens)
    page_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[1]
    group = num_heads // num_kv_heads
    counts = torch.tensor([b - a for a, b in zip(query_start_loc[:-1], query_start_loc[1:])],
                          device=device)
    max_queries = int(counts.max())
    block_keys = max(n - p for n, p in zip(kv_lens, prefix_lens))
    starts = torch.tensor(prefix_lens, device=device)
    block_positions = starts[:, None] + torch.arange(block_keys, device=device)  # [R, Bk]
    block_positions = block_positions.masked_fill(
        block_positions >= torch.tensor(kv_lens, device=device)[:, None], -1)
    key_positions = torch.cat([kept_index.to(device), block_positions[:, None].expand(
        -1, num_kv_heads, -1)], dim=-1)  # [R, H_kv, N]
    valid = key_positions >= 0
    safe = key_positions.clamp(min=0)
    table = block_table.to(device)
    pages = table.gather(1, (safe // page_size).flatten(1)).view_as(safe)
    heads = torch.arange(num_kv_heads, device=device)[None, :, None]
    keys, values = (view[pages, heads, safe % page_size].to(query.dtype)  # [R, H_kv, N, D]
                    for view in key_value_views(kv_cache))
    # Ragged rows -> [R, max_queries]
    request_of_row = torch.repeat_interleave(torch.arange(num_requests, device=device), counts)
    slot_of_row = (torch.arange(num_rows, device=device)
                   - torch.tensor(query_start_loc[:-1], device=device)[request_of_row])
    padded = query.new_zeros(num_requests, max_queries, num_heads, head_size)
    padded[request_of_row, slot_of_row] = query
    row_block = torch.full((num_requests, max_queries), 1 << 40, dtype=torch.long,
                           device=device)  # padding rows see every valid key
    row_block[request_of_row, slot_of_row] = query_positions.to(device) // diffusion_block_size
    visible = valid[:, :, None, :] & (
        safe[:, :, None, :] // diffusion_block_size <= row_block[:, None, :, None])  # [R,Hkv,Q,N]
    mask = visible[:, :, None].expand(-1, -1, group, -1, -1).reshape(
        num_requests, num_kv_heads, group * max_queries, -1)
    return grouped_attention(padded, keys, values, mask, scale)[request_of_row, slot_of_row]
