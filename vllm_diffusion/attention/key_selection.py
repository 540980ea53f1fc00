"""Attention for a step with a key selection (``step.keys.KeySelection``): the requests
that select score their prefix first (``kernels.sparse_prefix.select_prefix``), then the
block rows of the sparse requests attend to their kept prefix keys plus their block with
the sparse kernel and every other row attends densely."""

from __future__ import annotations

import torch

from vllm_diffusion.kernels.sparse_prefix import select_prefix
from vllm_diffusion.step.keys import KeySelection, RowSplit
from vllm_diffusion.step.rows import StepRows


def attend_with_key_selection(query: torch.Tensor, kv_cache: torch.Tensor, rows: StepRows,
                              block_table: torch.Tensor, block_size: int,
                              selection: KeySelection, scale: float, dense_kernel,
                              sparse_kernel, sum_heads=None, total_heads=None) -> torch.Tensor:
    """One layer's attention for a step with prefix sparsity (after its KV was written):
    first the requests that select score their prefix, then block rows of sparse requests
    attend with ``sparse_kernel`` and every other row with ``dense_kernel``."""
    md, loc, sparsity = rows, rows.query_start_loc, selection
    for scoring in sparsity.scoring:
        r = scoring.request
        block_query = query[loc[r + 1] - sparsity.block_rows[r]:loc[r + 1]]
        scoring.record(select_prefix(
            block_query, kv_cache, block_table[r], sparsity.prefix_lens[r], scale,
            scoring.keep, scoring.pool_kernel, scoring.per_kv_head, sum_heads, total_heads))
    if not sparsity.sparse:
        return dense_kernel(query, kv_cache, md.query_positions, loc, md.kv_lens,
                            block_table, block_size, scale)
    if sparsity.split is None:
        sparsity.split = RowSplit.of(loc, sparsity.block_rows, sparsity.sparse, query.device)
    split = sparsity.split
    output = torch.empty_like(query)
    output[split.sparse_index] = sparse_kernel(
        query[split.sparse_index], kv_cache, md.query_positions[split.sparse_index],
        split.sparse_loc, [md.kv_lens[r] for r in sparsity.sparse],
        block_table[split.sparse_requests.to(block_table.device)],
        block_size, scale, sparsity.kept_index,
        [sparsity.prefix_lens[r] for r in sparsity.sparse])
    if split.dense_index is not None:
        output[split.dense_index] = dense_kernel(
            query[split.dense_index], kv_cache, md.query_positions[split.dense_index],
            split.dense_loc, [md.kv_lens[r] for r in split.dense_requests],
            block_table[split.dense_request_index.to(block_table.device)],
            block_size, scale)
    return output
