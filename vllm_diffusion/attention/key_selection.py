"""Attention for a step with a key selection (``step.keys.KeySelection``): the scoring
requests score their context (``score_prefixes``), then the sparse requests' block rows
attend to their kept keys plus their block and every other row densely
(``attend_with_key_selection``); neither changes what it is given."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vllm_diffusion.kernels.sparse_prefix import select_prefix
from vllm_diffusion.step.keys import KeySelection, RowSplit, SelectedPrefix


def score_prefixes(query: torch.Tensor, kv_cache: torch.Tensor,
                   query_start_loc: Sequence[int], block_table: torch.Tensor,
                   selection: KeySelection, scale: float,
                   sum_heads: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   total_heads: int | None = None,
                   kv_lens: Sequence[int] | None = None) -> SelectedPrefix:
    """The context positions each scoring request's block queries select at this layer:
    before its block, and after it up to its ``kv_lens`` entry where its keys reach past
    the block (full attention).

    query: [T, H, D] the layer's queries; ``sum_heads`` and ``total_heads`` as in
    ``select_prefix`` (tensor parallel)."""
    selected = {}
    for scoring in selection.scoring:
        r = scoring.request
        end = query_start_loc[r + 1]
        block_query = query[end - selection.block_rows[r]:end]  # [n, H, D]
        block_end = selection.prefix_lens[r] + selection.block_rows[r]
        suffix = None if kv_lens is None else (block_end, kv_lens[r])
        selected[r] = select_prefix(
            block_query, kv_cache, block_table[r], selection.prefix_lens[r], scale,
            scoring.keep, scoring.pool_kernel, scoring.per_kv_head, sum_heads, total_heads,
            suffix)
    return selected


def block_ends(selection: KeySelection) -> list[int]:
    """The end of each sparse request's block keys (its keys past the block, where it
    has any, are reached through its kept positions only)."""
    return [selection.prefix_lens[r] + selection.block_rows[r] for r in selection.sparse]


def attend_with_key_selection(query: torch.Tensor, kv_cache: torch.Tensor, rows,
                              block_table: torch.Tensor, block_size: int,
                              selection: KeySelection, scale: float, dense_kernel,
                              sparse_kernel) -> torch.Tensor:
    """One layer's attention for a step with prefix sparsity (after its KV was written):
    block rows of sparse requests attend with ``sparse_kernel``, every other row with
    ``dense_kernel``. ``rows``: the layer's view (``query_positions``,
    ``query_start_loc``, ``kv_lens``); query [T, H, D]; returns [T, H, D]."""
    loc, kv_lens, positions = rows.query_start_loc, rows.kv_lens, rows.query_positions
    if not selection.sparse:
        return dense_kernel(query, kv_cache, positions, loc, kv_lens, block_table,
                            block_size, scale)
    split = selection.split or RowSplit.of(loc, selection.block_rows, selection.sparse,
                                           query.device)
    output = torch.empty_like(query)
    output[split.sparse_index] = sparse_kernel(
        query[split.sparse_index], kv_cache, positions[split.sparse_index],
        split.sparse_loc, block_ends(selection),
        block_table[split.sparse_requests.to(block_table.device)],
        block_size, scale, selection.kept_index,
        [selection.prefix_lens[r] for r in selection.sparse], selection.kept_kv)
    if split.dense_index is not None:
        output[split.dense_index] = dense_kernel(
            query[split.dense_index], kv_cache, positions[split.dense_index],
            split.dense_loc, [kv_lens[r] for r in split.dense_requests],
            block_table[split.dense_request_index.to(block_table.device)],
            block_size, scale)
    return output
