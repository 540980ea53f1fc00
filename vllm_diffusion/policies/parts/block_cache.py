"""The neighbour-aware intra-block cache (FOCUS section 4.3), shared by the policies that
reuse decoded positions' KV within a block; which positions a step computes. ``RULES``:
``after_neighbour`` drops a decoded position once it and its right neighbour were decoded
before the step, ``after_recompute`` after the step that recomputed it with its token,
``immediate`` as soon as it is decoded (its KV stays the mask token's).
"""

from __future__ import annotations

import dataclasses

import torch

RULES = ("after_neighbour", "after_recompute", "immediate")


@dataclasses.dataclass
class IntraBlockCache:
    """Neighbour-aware delayed cache of one block (FOCUS Section 4.3)."""

    block_size: int
    uncached: torch.Tensor = None  # [B] bool, positions whose KV is not frozen
    warm: bool = False  # False until the block's first step has processed everything
    rule: str = "after_neighbour"  # one of RULES

    def __post_init__(self) -> None:
        if self.uncached is None:
            self.uncached = torch.ones(self.block_size, dtype=torch.bool)

    def processing_set(self) -> torch.Tensor:
        """[B] bool: the positions to compute this step."""
        if not self.warm or not bool(self.uncached.any()):
            return torch.ones(self.block_size, dtype=torch.bool)
        return self.uncached.clone()

    def update(self, masked_before_step: torch.Tensor,
               masked_after_step: torch.Tensor | None = None,
               computed: torch.Tensor | None = None) -> None:
        """After a step, given which positions were masked before its unmasking (and,
        for ``immediate``, after it). ``computed`` ([B] bool, through every layer): where a
        step may leave out uncached positions (a chunk window that shrinks), only a
        computed position can be cached."""
        self.warm = True
        if self.rule == "immediate":
            self.uncached &= masked_after_step
            return
        if self.rule == "after_recompute":
            self.uncached &= masked_before_step
            return
        decoded = ~masked_before_step
        right_decoded = torch.ones_like(decoded)  # the last position has no right neighbour
        right_decoded[:-1] = decoded[1:]
        settled = decoded & right_decoded
        if computed is not None:
            settled &= computed
        self.uncached &= ~settled
