"""Fast-dLLM v2's block cache (its ``use_block_cache``), the ``standard`` policy's option
``sub_block_cache``: a step computes the whole block when the block's KV is not written
yet or the active sub-block (the leftmost holding a mask) starts with a mask, else only
the active sub-block's rows against the block's cached KV (partly stale). The commit
recomputes the block whole, so committed KV stays exact. Shifted logits: each masked
position of the sub-block reads a row of it (``worker/shifted_plan.py``).
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
        """computed: [B] bool, the positions whose logits the step read. A whole-block plan
        writes the block's KV unless the step computed none of its rows (a shifted model's
        step reading the block's first position at the previous block's commit)."""
        if self.planned_whole and bool(computed[-1]):
            self.written = True
