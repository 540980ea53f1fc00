"""Block-causal attention on CPU through vLLM's CPU attention kernel (non-causal over a
segment's first ``seq_len`` keys): the rows of one request in one diffusion block form a
segment seeing keys [0, min(kv_len, block end)), planned once per step (``plan_segments``)
and attended per layer in one call (``attend_segments``). The cache is split
(``kernels.kv_pages``), as vLLM's portable ``vec16`` / ``vec`` kernels read it.
Sparse-dLLM's attention runs on the same kernel (``kept_pages_attention``).
"""

from __future__ import annotations

import dataclasses

import torch

from vllm import _custom_ops as ops

from vllm_diffusion.kernels.kv_pages import key_value_views
from vllm_diffusion.kernels.sparse_prefix import (KeptKV, compacted_sparse_prefix_attention,
                                                    stored_requests)


@dataclasses.dataclass
class SegmentPlan:
    """A step's query rows as segments of one request and one diffusion block."""

    query_start_loc: torch.Tensor  # [S + 1] int32 row offsets of the segments
    seq_lens: torch.Tensor  # [S] int32 keys each segment sees
    block_table: torch.Tensor  # [S, max_pages] int32 its request's pages
    scheduler_metadata: torch.Tensor  # vLLM's work split for these segments
    num_rows: int


def cpu_kernel_supports(head_size: int) -> bool:
    """Whether vLLM's CPU attention has a kernel for this head size."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return head_size in CPUAttentionBackend.get_supported_head_sizes()


def portable_isa(page_size: int) -> str:
    """vLLM's portable CPU kernel for a page size (the one that reads the split pages)."""
    return "vec" if page_size % 32 == 0 else "vec16"


def plan_segments(query_positions: torch.Tensor, query_start_loc: list[int],
                  kv_lens: list[int], block_table: torch.Tensor, diffusion_block_size: int,
                  num_heads: int, kv_cache: torch.Tensor) -> SegmentPlan:
    """The segments of a step's rows (positions [T], R + 1 row offsets, R key counts,
    [R, max_pages] pages) for a cache [num_pages, H_kv, page_size, 2D]."""
    # A few rows per request: the segments are found in Python (one host read of the
    # positions), not by a dozen small tensor ops.
    positions = query_positions.tolist()
    starts: list[int] = []  # first row of each segment
    seq_lens: list[int] = []  # keys each segment sees
    segment_request: list[int] = []
    for request, (first, end) in enumerate(zip(query_start_loc[:-1], query_start_loc[1:])):
        block = None
        for row in range(first, end):
            if positions[row] // diffusion_block_size != block:
                block = positions[row] // diffusion_block_size
                starts.append(row)
                seq_lens.append(min(kv_lens[request], (block + 1) * diffusion_block_size))
                segment_request.append(request)
    num_rows = int(query_start_loc[-1])
    loc = torch.tensor([*starts, num_rows], dtype=torch.int32)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    pages = block_table.cpu().to(torch.int32)
    if segment_request != list(range(len(kv_lens))):  # a request with several segments
        pages = pages[torch.tensor(segment_request, dtype=torch.long)]
    return SegmentPlan(loc, seq_lens, pages, _scheduler_metadata(loc, seq_lens, num_heads,
                                                                 kv_cache), num_rows)


def _scheduler_metadata(loc: torch.Tensor, seq_lens: torch.Tensor, num_heads: int,
                        kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's work split for non-causal segments (``loc`` [S + 1] int32 row offsets,
    ``seq_lens`` [S] int32) over ``kv_cache``."""
    _, num_kv_heads, page_size, two_d = kv_cache.shape
    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens), num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=two_d // 2, seq_lens=seq_lens, dtype=kv_cache.dtype, query_start_loc=loc,
        causal=False, sliding_window_size=-1, isa=portable_isa(page_size),
        enable_kv_split=False)


def write_kv_with_vllm(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """``kernels.block_attention.write_kv`` through vLLM's CPU cache-write kernel (one call,
    negative slots skipped); key, value: [T, H_kv, D]; slot_mapping: [T] int64."""
    key_cache, value_cache = _vllm_cache_halves(kv_cache)
    ops.cpu_attn_reshape_and_cache(key.to(kv_cache.dtype).contiguous(),
                                   value.to(kv_cache.dtype).contiguous(), key_cache,
                                   value_cache, slot_mapping, portable_isa(kv_cache.shape[2]))


def _vllm_cache_halves(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value halves of a contiguous cache [num_pages, H_kv, page_size, 2D] as
    vLLM's CPU kernels take them."""
    num_pages, num_kv_heads, page_size, two_d = kv_cache.shape
    if not kv_cache.is_contiguous():
        raise ValueError("vLLM's CPU attention needs a contiguous KV cache")
    halves = kv_cache.view(num_pages, num_kv_heads, 2 * page_size, two_d // 2)
    return halves.chunk(2, dim=2)


def attend_segments(query: torch.Tensor, kv_cache: torch.Tensor, plan: SegmentPlan,
                    scale: float, output: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's attention of the planned rows. query: [T, H, D]; returns [T, H, D],
    written into ``output`` where given."""
    if output is not None and not output.is_contiguous():  # the kernel writes rows densely
        output.copy_(attend_segments(query, kv_cache, plan, scale))
        return output
    if output is None:
        output = torch.empty_like(query)
    if plan.num_rows == 0:
        return output
    key_cache, value_cache = _vllm_cache_halves(kv_cache)
    ops.cpu_attention_with_kv_cache(
        query=query.contiguous(), key_cache=key_cache, value_cache=value_cache,
        output=output, query_start_loc=plan.query_start_loc, seq_lens=plan.seq_lens,
        scale=scale, causal=False, alibi_slopes=None, sliding_window=-1,
        block_table=plan.block_table, softcap=0.0,
        scheduler_metadata=plan.scheduler_metadata, s_aux=None)
    return output


def segmented_block_causal_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                                     query_positions: torch.Tensor,
                                     query_start_loc: list[int], kv_lens: list[int],
                                     block_table: torch.Tensor, diffusion_block_size: int,
                                     scale: float) -> torch.Tensor:
    """``block_causal_attention`` through vLLM's CPU kernel (plan and attend at once)."""
    plan = plan_segments(query_positions, query_start_loc, kv_lens, block_table,
                         diffusion_block_size, query.shape[1], kv_cache)
    return attend_segments(query, kv_cache, plan, scale)


def kept_pages_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                         query_positions: torch.Tensor, query_start_loc: list[int],
                         kv_lens: list[int], block_table: torch.Tensor,
                         diffusion_block_size: int, scale: float, kept_index: torch.Tensor,
                         prefix_lens: list[int],
                         kept_kv: list[KeptKV] | None = None) -> torch.Tensor:
    """``sparse_prefix_attention`` through vLLM's CPU kernel over each request's store
    (``KeptKV.pages``), filled with the kept keys and values on its first call (slot t of
    KV head h: that head's t-th kept position; attended non-causally, so their order does
    not matter), the block's keys written after them at each call. The torch path runs
    without stores, and where a request's block keys [prefix_len, kv_len) reach over more
    than one diffusion block (its rows may need a mask inside the block)."""
    if kept_kv is None or any(p // diffusion_block_size < (n - 1) // diffusion_block_size
                              for p, n in zip(prefix_lens, kv_lens)):
        return compacted_sparse_prefix_attention(
            query, kv_cache, query_positions, query_start_loc, kv_lens, block_table,
            diffusion_block_size, scale, kept_index, prefix_lens, kept_kv)
    output = torch.empty_like(query)
    views = key_value_views(kv_cache)
    heads = torch.arange(kv_cache.shape[1], device=query.device)[:, None]
    for request in stored_requests(query_start_loc, kv_lens, block_table, prefix_lens,
                                   kept_kv, query.device):
        store, rows = request.store, request.rows
        if store.pages is None or len(store.block_slots) != request.block:
            _fill_kept_pages(store, *request.kept_kv(kept_index, views, heads), request.block,
                             kv_cache)
        if store.plan is None or store.plan.num_rows != rows.stop - rows.start:
            store.plan = _store_plan(store, rows.stop - rows.start, query.shape[1])
        block_keys, block_values = request.block_kv(views, heads)  # [H_kv, n, D] each
        write_kv_with_vllm(store.pages, block_keys.transpose(0, 1),
                           block_values.transpose(0, 1), store.block_slots)
        attend_segments(query[rows], store.pages, store.plan, scale, output[rows])
    return output


def _fill_kept_pages(store: KeptKV, keys: torch.Tensor, values: torch.Tensor, block: int,
                     kv_cache: torch.Tensor) -> None:
    """A new store of the kept positions' keys and values ([H_kv, K, D] each) with room for
    ``block`` keys after them."""
    store.kept = keys.shape[1]
    num_pages = -(-(store.kept + block) // kv_cache.shape[2])
    store.pages = kv_cache.new_zeros(num_pages, *kv_cache.shape[1:])
    write_kv_with_vllm(store.pages, keys.transpose(0, 1), values.transpose(0, 1),
                       torch.arange(store.kept, device=kv_cache.device))
    store.block_slots = torch.arange(store.kept, store.kept + block, device=kv_cache.device)
    store.plan = None


def _store_plan(store: KeptKV, rows: int, num_heads: int) -> SegmentPlan:
    """vLLM's kernel plan for ``rows`` query rows over the whole store."""
    loc = torch.tensor([0, rows], dtype=torch.int32)
    seq_lens = torch.tensor([store.kept + len(store.block_slots)], dtype=torch.int32)
    table = torch.arange(store.pages.shape[0], dtype=torch.int32)[None]
    return SegmentPlan(loc, seq_lens, table,
                       _scheduler_metadata(loc, seq_lens, num_heads, store.pages), rows)
