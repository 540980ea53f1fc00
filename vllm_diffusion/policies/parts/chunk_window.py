"""Chunked decoding's window (Optimus, section 4.4), a component of ``standard`` and
``elastic``: with chunk size c a step computes the first c undecided positions and the
decoded ones left of them (the whole block once no more than c are undecided); nothing
right of the window. With ``chunk_reuse`` decoded positions keep their KV by the
intra-block cache's rule. Where logits are shifted the window is of rows and the cache
decides rows, updated from the rows planned (docs/policies.md, "elastic").
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_diffusion.options import OptionError, Rule, option
from vllm_diffusion.policies.parts.block_cache import IntraBlockCache
from vllm_diffusion.policies.parts.strategy_config import StrategyConfig
from vllm_diffusion.step.plans import WHOLE_BLOCK, BlockStepPlan
from vllm_diffusion.step.request import BlockCanvas


@dataclasses.dataclass(frozen=True)
class ChunkConfig(StrategyConfig):
    """The strategy options plus the chunk window's."""

    # Positions computed per step (None: the whole block); must divide the block size.
    chunk_size: int | None = option(None, Rule(int, low=1, high=1024, optional=True))
    chunk_reuse: bool = option(False, Rule(bool))

    def validate_for_block(self, block_size: int, source: str) -> None:
        super().validate_for_block(block_size, source)
        if self.chunk_size is not None or self.chunk_reuse:
            self.refuse_editing_with(source, "with 'chunk_size' or 'chunk_reuse' (positions "
                                             "outside the chunk or reused from the cache "
                                             "get no new proposal)")
        if self.chunk_size is not None and block_size % self.chunk_size:
            raise OptionError(
                f"{source}: option 'chunk_size' must divide the block size ({block_size}), "
                f"got {self.chunk_size}")


@dataclasses.dataclass
class ChunkWindow:
    """Per request: this step's chunk and, with ``chunk_reuse``, the current block's
    intra-block cache."""

    block_size: int
    chunk: int | None = None  # this step's chunk size (None: whole block)
    cache: IntraBlockCache | None = None
    planned: torch.Tensor | None = None  # [B] bool: the rows this step's plan computes

    def start_block(self) -> None:
        self.cache = None  # made by the block's first step that reuses KV

    def plan(self, canvas: BlockCanvas, mask_token_id: int, chunk: int | None,
             reuse: bool) -> BlockStepPlan:
        """The step's plan for the block ``canvas``."""
        self.chunk = chunk
        if chunk is None and not reuse:  # whole-block decoding
            return WHOLE_BLOCK
        masked = canvas.masked(mask_token_id)
        undecided = torch.nonzero(masked).flatten()
        # The window ends after the chunk-th undecided position, or at the block end when
        # no more than a chunk is left undecided.
        whole = chunk is None or len(undecided) <= chunk
        window_end = None if whole else int(undecided[chunk - 1]) + 1
        if not reuse:
            if whole:
                return WHOLE_BLOCK
            return BlockStepPlan(torch.arange(self.block_size) < window_end, window_end)
        if self.cache is None:
            self.cache = IntraBlockCache(self.block_size)
        compute = masked | self.cache.processing_set()
        if not whole:
            compute &= torch.arange(self.block_size) < window_end
        self.planned = compute
        return BlockStepPlan(compute, window_end)

    def after_step(self, masked_before: torch.Tensor, computed: torch.Tensor,
                   reuse: bool, shifted: bool = False) -> None:
        """masked_before, computed: [B] bool (through every layer; a shrinking window leaves
        decoded positions out); ``shifted``: the cache takes the planned rows."""
        if reuse:
            rows = self.planned if shifted and self.planned is not None else computed
            self.cache.update(masked_before, computed=rows)
