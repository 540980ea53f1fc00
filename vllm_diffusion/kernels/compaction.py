"""Compaction of a step's row states to the rows kept after eviction: ``compact_rows``
gathers the kept rows of the hidden states and the residual stream ([T, hidden] each).
"""

from __future__ import annotations

import torch


def compact_rows(hidden: torch.Tensor, residual: torch.Tensor | None,
                 keep_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    return hidden[keep_rows], None if residual is None else residual[keep_rows]
