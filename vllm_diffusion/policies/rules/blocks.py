"""What a commit rule sees (``RuleBlocks``: the step's blocks that follow it, stacked, with
the quantities rules share computed once, on first use) and what it is (``CommitRule``).
Rules cheap to decide in Python decide small steps on the host (``HostPathRule``): at
batch 1 and block 4 a dozen tensor operations cost more than the decision itself.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import struct
from collections.abc import Callable, Collection, Sequence
from typing import Any, ClassVar

import torch

MAX_HOST_POSITIONS = 256  # R * B; beyond it the tensor path is cheaper


def step_quota(block_size: int, steps: int, step: int) -> int:
    """Positions to commit at denoising step ``step`` of a block (SDAR's schedule)."""
    if step >= steps:
        return block_size
    return block_size // steps + (1 if step < block_size % steps else 0)


def rank_by_score(score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, rank) [R, B]: each block's positions by score descending, and each
    position's rank in that order (ties to the lower position); score: [R, B]."""
    order = torch.sort(score, dim=1, descending=True, stable=True).indices
    return order, torch.empty_like(order).scatter_(
        1, order, torch.arange(score.shape[1]).expand_as(order).contiguous())


def as_float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (as ``torch.tensor(value)`` holds it), so
    that the host path compares as the tensor path does."""
    return struct.unpack("f", struct.pack("f", value))[0]


# A block decided on the host: (confidence [B], its candidate positions in order, its
# steps taken, its steps allowed, its config) -> the positions it commits.
HostChoice = Callable[[list[float], list[int], int, int, Any], Collection[int]]


@dataclasses.dataclass(eq=False)
class RuleBlocks:
    """R blocks of a step, stacked (host tensors). confidence: [R, B] float32 of each
    proposal, -inf where none; candidates: [R, B] bool, the masked positions the step may
    commit; steps_taken (the block's denoising steps before this one) and steps_allowed
    (its ``steps_for``): per block; configs: each block's ``StrategyConfig``; entropy:
    [R, B] float32 of each proposal's distribution, where a rule asked for it."""

    confidence: torch.Tensor
    candidates: torch.Tensor
    steps_taken: Sequence[int]
    steps_allowed: Sequence[int]
    configs: Sequence[Any]
    entropy: torch.Tensor | None = None

    def rows(self, index: list[int]) -> RuleBlocks:
        """The blocks at ``index``."""
        at = torch.tensor(index, dtype=torch.long)
        return RuleBlocks(self.confidence[at], self.candidates[at],
                          [self.steps_taken[i] for i in index],
                          [self.steps_allowed[i] for i in index],
                          [self.configs[i] for i in index],
                          None if self.entropy is None else self.entropy[at])

    @property
    def small(self) -> bool:
        """Whether a host path decides these blocks faster than tensor operations."""
        return self.candidates.numel() <= MAX_HOST_POSITIONS

    def option(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[R]: each block's option ``name``."""
        return torch.tensor([getattr(c, name) for c in self.configs], dtype=dtype)

    def on_host(self, choose: HostChoice) -> torch.Tensor:
        """[R, B] bool: each block's commits as ``choose`` picks them in Python (blocks
        without a candidate commit nothing)."""
        block = self.candidates.shape[1]
        chosen = []
        for confidence, masked, taken, allowed, config in zip(
                self.confidence.tolist(), self.candidates.tolist(), self.steps_taken,
                self.steps_allowed, self.configs):
            candidates = [j for j in range(block) if masked[j]]
            picked = choose(confidence, candidates, taken, allowed, config) \
                if candidates else ()
            chosen.append([j in picked for j in range(block)])
        return torch.tensor(chosen, dtype=torch.bool)

    @functools.cached_property
    def num_masked(self) -> torch.Tensor:  # [R] int64
        return self.candidates.sum(dim=1)

    @functools.cached_property
    def taken(self) -> torch.Tensor:  # [R] int64
        return torch.tensor(self.steps_taken, dtype=torch.long)

    @functools.cached_property
    def allowed(self) -> torch.Tensor:  # [R] int64
        return torch.tensor(self.steps_allowed, dtype=torch.long)

    @functools.cached_property
    def last_step(self) -> torch.Tensor:  # [R, 1] bool: the block's last allowed step
        return (self.taken >= self.allowed - 1)[:, None]

    @functools.cached_property
    def masked_confidence(self) -> torch.Tensor:  # [R, B]: -inf off the candidates
        return torch.where(self.candidates, self.confidence,
                           torch.full_like(self.confidence, float("-inf")))

    @functools.cached_property
    def ranked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(order, rank) [R, B] of the candidates by confidence, best first (ties to the
        lower position)."""
        return rank_by_score(self.masked_confidence)

    @functools.cached_property
    def quota(self) -> torch.Tensor:  # [R, 1]: SDAR's quota of this step
        block = self.candidates.shape[1]
        allowed, taken = self.allowed, self.taken
        base, extra = block // allowed, block % allowed
        count = torch.where(taken >= allowed, torch.full_like(base, block),
                            base + (taken < extra).long())
        return torch.minimum(count, self.num_masked)[:, None]

    @functools.cached_property
    def top_by_quota(self) -> torch.Tensor:  # [R, B] bool: the quota's most confident
        return (self.ranked[1] < self.quota) & self.candidates


class CommitRule(abc.ABC):
    """An unmasking rule: which candidates of its blocks a step commits. One instance
    serves every request; what a block's options say is in ``RuleBlocks.configs``."""

    name: ClassVar[str]

    def needs_entropy(self, config: Any) -> bool:
        """Whether the rule reads each proposal's entropy for a block with ``config``."""
        return False

    @abc.abstractmethod
    def step(self, blocks: RuleBlocks) -> torch.Tensor:
        """[R, B] bool: the candidates each block commits, at least one where it has one
        (unless ``idle`` says the step is empty by design)."""

    def idle(self, blocks: RuleBlocks) -> list[bool]:
        """Per block: whether its schedule commits nothing this step by design (it must
        then end the block itself within a bounded number of steps). Default: never."""
        return [False] * len(blocks.configs)


class HostPathRule(CommitRule):
    """A rule with a host path: its ``host_choice`` decides small steps
    (``RuleBlocks.small``) in Python, its ``by_tensors`` the others (tested equal)."""

    def step(self, blocks: RuleBlocks) -> torch.Tensor:
        if blocks.small:
            return blocks.on_host(self.host_choice)
        return self.by_tensors(blocks)

    @staticmethod
    @abc.abstractmethod
    def host_choice(confidence: list[float], candidates: list[int], steps_taken: int,
                    steps_allowed: int, config: Any) -> Collection[int]:
        """The positions one block commits (a ``HostChoice``)."""

    @abc.abstractmethod
    def by_tensors(self, blocks: RuleBlocks) -> torch.Tensor:
        """``step`` by tensor operations, whatever the blocks' size."""
