"""Key selection: which committed-prefix keys a request's block rows attend to at a layer.
A ``KeySelection`` from a policy's hooks is honoured by that layer's attention
(``attention/key_selection.py``): ``sparse`` requests' block rows attend to their kept
prefix positions plus their block; ``scoring`` requests attend densely and select their
kept positions (``SelectedPrefix``, back through ``StepHooks.after_key_scoring``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import torch

# Request index in the step -> the prefix positions its block's queries selected at a
# layer: [H_sel, keep] int64, ascending (H_sel: 1, or H_kv with ``per_kv_head``).
SelectedPrefix = dict[int, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class KeyScoring:
    """A request whose block queries select its kept prefix positions at this layer (its
    attention is dense this step)."""

    request: int  # index of the request in the step
    keep: int  # positions kept, at most the prefix length
    pool_kernel: int  # odd
    per_kv_head: bool


@dataclasses.dataclass(frozen=True)
class RowSplit:
    """A step's rows split between sparse attention (block rows of the sparse requests)
    and dense attention (every other row), with each side's request offsets."""

    sparse_index: torch.Tensor  # [T_s] rows attended sparsely
    sparse_loc: list[int]  # len(sparse) + 1 row offsets
    sparse_requests: torch.Tensor  # [len(sparse)] their request indices
    dense_index: torch.Tensor | None  # [T_d] the other rows (None: none)
    dense_loc: list[int]
    dense_requests: list[int]
    dense_request_index: torch.Tensor  # [len(dense_requests)]

    @classmethod
    def of(cls, query_start_loc: Sequence[int], block_rows: Sequence[int],
           sparse: Sequence[int], device: torch.device) -> RowSplit:
        ends = query_start_loc[1:]
        first_sparse = {r: ends[r] - block_rows[r] for r in sparse}
        sparse_rows = [i for r in sparse for i in range(first_sparse[r], ends[r])]
        sparse_loc = list(itertools.accumulate((block_rows[r] for r in sparse), initial=0))
        dense_rows, dense_loc, dense_requests = [], [0], []
        for r, start in enumerate(query_start_loc[:-1]):
            end = first_sparse.get(r, ends[r])
            if end > start:
                dense_requests.append(r)
                dense_rows.extend(range(start, end))
                dense_loc.append(dense_loc[-1] + end - start)
        return cls(torch.tensor(sparse_rows, device=device), sparse_loc,
                   torch.tensor(list(sparse), device=device),
                   torch.tensor(dense_rows, device=device) if dense_rows else None,
                   dense_loc, dense_requests, torch.tensor(dense_requests, device=device))


@dataclasses.dataclass(frozen=True)
class KeySelection:
    """One layer's key selection for a step: which committed-prefix keys the block rows of
    some requests attend to (kept-index lists), and which requests select theirs at this
    layer; sequences are indexed like the step's requests."""

    block_rows: Sequence[int]  # rows at the end of each request's rows in its block
    prefix_lens: Sequence[int]  # each request's block start
    sparse: Sequence[int]  # requests whose block rows attend to kept prefix positions only
    kept_index: torch.Tensor | None  # [len(sparse), H_kv, K] int64 (model device), -1 pad
    scoring: Sequence[KeyScoring]
    # the rows' split, the same at every layer of a step: made once by the hooks that
    # select; None: the attention splits the rows for its own call
    split: RowSplit | None = None
    # per sparse request, its store of this layer's kept keys and values
    # (``kernels.sparse_prefix.KeptKV``, held by the policy while the selection stands),
    # which the CPU path fills once and reads after; None: gathered every step
    kept_kv: Sequence[Any] | None = None
