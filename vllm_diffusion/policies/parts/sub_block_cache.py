"""Fast-dLLM v2's block cache (its published ``generate``'s ``use_block_cache``), a
component of the standard policy (option ``sub_block_cache``), for blocks decoded in
sub-blocks left to right (``sub_block_size``).

A step computes the whole block when the block's KV is not written yet (its first step,
or the first after a preemption freed it) or when the active sub-block (the leftmost one
holding a mask) starts with a masked position: a new sub-block refreshes the block's KV.
Otherwise it computes only the active sub-block's rows: their KV is rewritten inside the
block, and they attend to the committed prefix and to the whole block's cached KV, the
rest of it as the last refresh left it (stale: computed before the tokens decoded
since). The commit of a completed block recomputes it whole, so committed KV stays exact.

Where logits are shifted (Fast-dLLM v2: position j read from row j - 1), the active
sub-block's first position is known in every step that computes only the sub-block, so
each of its masked positions reads a row of the sub-block (``worker/shifted_plan.py``).
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_diffusion.step.plans import WHOLE_BLOCK, BlockStepPlan
from vllm_diffusion.step.request import BlockCanvas


@dataclasses.dataclass
class SubBlockCache:
    """Per request: whether the current block's KV is written whole, and what this step
    planned."""

    block_size: int
    written: bool = False  # a step computed the whole block since the block started
    planned_whole: bool = False  # this step's plan is the whole block

    def start_block(self) -> None:
        """A new block, or the same block whose KV a preemption freed."""
        self.written = False

    def plan(self, canvas: BlockCanvas, mask_token_id: int,
             sub_block_size: int | None) -> BlockStepPlan:
        """The step's plan for the block ``canvas``."""
        masked = canvas.masked(mask_token_id)  # [B] bool
        self.planned_whole = True
        if not self.written or not bool(masked.any()):
            return WHOLE_BLOCK
        size = sub_block_size or self.block_size
        start = int(torch.nonzero(masked)[0]) // size * size
        if bool(masked[start]):  # a sub-block starts: refresh the block's KV
            return WHOLE_BLOCK
        self.planned_whole = False
        compute = torch.zeros(self.block_size, dtype=torch.bool)
        compute[start:start + size] = True
        return BlockStepPlan(compute)

    def after_step(self, computed: torch.Tensor) -> None:
        """computed: [B] bool, the positions whose logits the step read. A whole-block
        plan writes the block's KV unless the step computed none of its rows (a shifted
        model's step that reads the block's first position from the previous block's
        last row, at that block's commit): the block's last position tells them apart."""
        if self.planned_whole and bool(computed[-1]):
            self.written = True
