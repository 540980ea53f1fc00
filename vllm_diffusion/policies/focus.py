"""FOCUS: evict non-decodable tokens of a block after layer 1 (arXiv 2601.23278).

At layers 0 and 1 the importance of every masked candidate (``attention/importance.py``)
gives the delta I1 - I0; the top-K candidates by delta (K from ``token_budget``), with the
structural constraints of ``select_retained``, continue through layer 1's attention and
every later layer; the others are evicted for this step and stay masked. Decoded positions
stop being recomputed once they and their right neighbour are decoded
(``IntraBlockCache``). The unmasking rule (the standard strategies) sees only retained
positions. With ``evict=False`` and ``intra_block_cache=False`` every step computes the
whole block and FOCUS decodes exactly like ``standard``.

Commit of a completed block: ``exact`` re-encodes the decoded block in the next step (its
committed KV equals a clean forward); ``delayed`` recomputes only the positions the
intra-block cache has not frozen (those decoded at the block's last steps), as the
paper's implementation does, and keeps the frozen positions' KV.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from vllm_diffusion.options import Rule, option
from vllm_diffusion.policies.focus_selection import IntraBlockCache, select_retained, token_budget
from vllm_diffusion.policies.standard import STRATEGIES, StandardPolicy, StandardPolicyConfig


@dataclasses.dataclass(frozen=True)
class FocusPolicyConfig(StandardPolicyConfig):
    # Options a request may not change: committed KV is shared through the prefix cache.
    engine_only: ClassVar[tuple[str, ...]] = ("commit",)

    strategy: str = option("threshold", Rule(str, choices=STRATEGIES))
    threshold: float = option(0.8, Rule(float, low=0.0, high=1.0))  # the paper's setting
    alpha: float = option(1.5, Rule(float, low=1.0, high=64.0, low_inclusive=False))  # > 1 (paper)
    pool_kernel: int = option(3, Rule(int, low=1, high=15))
    evict: bool = option(True, Rule(bool))
    intra_block_cache: bool = option(True, Rule(bool))
    commit: str = option("exact", Rule(str, choices=("exact", "delayed")))

    def validate_for_block(self, block_size: int, source: str) -> None:
        super().validate_for_block(block_size, source)
        if self.pool_kernel % 2 == 0:
            from vllm_diffusion.options import OptionError

            raise OptionError(f"{source}: option 'pool_kernel' must be odd, got {self.pool_kernel}")


@dataclasses.dataclass
class FocusRequestState:
    """FOCUS state of one request; the block-level parts reset at each block."""

    block_size: int
    decoded_steps: int = 0
    decoded_tokens: int = 0
    block_start: int = -1
    cache: IntraBlockCache | None = None
    # [B] bool: positions that went through every layer at some step of this block (so
    # their KV is valid at all layers)
    ever_processed: torch.Tensor | None = None

    def start_block(self, block_start: int, kv_lost: bool = False) -> None:
        """Begin (or, when its KV was lost to a preemption, restart) the block."""
        if block_start != self.block_start or kv_lost:
            self.block_start = block_start
            self.cache = IntraBlockCache(self.block_size)
            self.ever_processed = torch.zeros(self.block_size, dtype=torch.bool)

    @property
    def mean_decoded(self) -> float:
        """Running mean of tokens decoded per step (1 before the first step)."""
        return self.decoded_tokens / self.decoded_steps if self.decoded_steps else 1.0

    def commit_positions(self, num_computed: int, config: FocusPolicyConfig) -> torch.Tensor | None:
        """[B] bool: positions of the completed block starting at ``num_computed`` to
        recompute when committing it (None: all, the exact commit)."""
        if config.commit != "delayed" or self.block_start != num_computed or self.cache is None:
            return None
        return self.cache.uncached.clone()

    def processing_set(self, config: FocusPolicyConfig) -> torch.Tensor:
        """[B] bool: the block positions computed this step."""
        if not config.intra_block_cache:
            return torch.ones(self.block_size, dtype=torch.bool)
        return self.cache.processing_set()

    def budget(self, delta: torch.Tensor, candidates: torch.Tensor,
               config: FocusPolicyConfig) -> int | None:
        """K for this step, or None when nothing is evicted. delta: [B] (read at candidates)."""
        if not config.evict or not bool(candidates.any()):
            return None
        budget = token_budget(delta[candidates], self.mean_decoded, config.alpha, self.block_size)
        return budget if budget < int(candidates.sum()) else None

    def retained(self, delta: torch.Tensor, candidates: torch.Tensor, processing: torch.Tensor,
                 config: FocusPolicyConfig) -> torch.Tensor:
        """[B] bool: positions kept after layer 1 (the engine batches this over requests)."""
        budget = self.budget(delta, candidates, config)
        if budget is None:
            return processing.clone()
        return select_retained(delta, candidates, budget, processing, self.ever_processed)

    def after_step(self, masked_before: torch.Tensor, retained: torch.Tensor,
                   num_decoded: int) -> None:
        """retained: [B] bool, the positions that went through every layer this step."""
        self.cache.update(masked_before)
        self.ever_processed |= retained
        self.decoded_steps += 1
        self.decoded_tokens += num_decoded


class FocusPolicy(StandardPolicy):
    """Unmasks like ``standard``; the runner passes only retained positions as masked."""

    name: ClassVar[str] = "focus"
    config_cls: ClassVar[type] = FocusPolicyConfig
