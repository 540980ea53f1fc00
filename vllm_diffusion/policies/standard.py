"""Standard block-diffusion decoding: every step computes the whole block.

Unmasking strategies follow SDAR's published ``generate.py`` and LMDeploy:

- ``low_confidence_dynamic`` (SDAR): commit every masked position whose confidence is
  above ``threshold`` if there are at least the step's quota of them, else the top quota.
- ``low_confidence_static``: commit the top quota by confidence.
- ``sequential``: commit the leftmost quota of masked positions.
- ``threshold`` (LMDeploy / SGLang): commit the most confident masked position plus every
  masked position with confidence at least ``threshold``.

The quota of step ``s`` spreads the block over ``denoising_steps`` steps
(``B // steps`` plus one for the first ``B % steps`` steps), so every strategy finishes a
block within ``denoising_steps`` steps; ``threshold`` commits everything left at its last
allowed step.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from vllm_diffusion.options import OptionError, Rule, option

STRATEGIES = ("low_confidence_dynamic", "low_confidence_static", "sequential", "threshold")


@dataclasses.dataclass(frozen=True)
class StandardPolicyConfig:
    strategy: str = option("low_confidence_dynamic", Rule(str, choices=STRATEGIES))
    threshold: float = option(0.9, Rule(float, low=0.0, high=1.0))
    # Cap on denoising steps per block; None means one step per block position.
    denoising_steps: int | None = option(None, Rule(int, low=1, high=4096, optional=True))

    def validate_for_block(self, block_size: int, source: str) -> None:
        if self.denoising_steps is not None and self.denoising_steps > block_size:
            raise OptionError(
                f"{source}: option 'denoising_steps' must be at most the block size "
                f"({block_size}), got {self.denoising_steps}"
            )

    def steps_for(self, block_size: int) -> int:
        return self.denoising_steps or block_size


def step_quota(block_size: int, steps: int, step: int) -> int:
    """Positions to commit at denoising step ``step`` of a block (SDAR's schedule)."""
    if step >= steps:
        return block_size
    return block_size // steps + (1 if step < block_size % steps else 0)


def top_by_confidence(confidence: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest confidences; ties go to the lower position."""
    order = torch.sort(confidence, descending=True, stable=True).indices
    return order[:k]


def choose_commits(confidence: torch.Tensor, masked: torch.Tensor, step: int,
                   block_size: int, config: StandardPolicyConfig) -> torch.Tensor:
    """Which positions of one block to commit this step.

    confidence: [B] float, the probability of each position's proposed token.
    masked:     [B] bool, positions still holding the mask token.
    Returns a [B] bool tensor; only masked positions are ever chosen, at least one if any
    position is masked.
    """
    num_masked = int(masked.sum())
    commit = torch.zeros_like(masked)
    if num_masked == 0:
        return commit
    steps = config.steps_for(block_size)
    quota = min(step_quota(block_size, steps, step), num_masked)
    conf = torch.where(masked, confidence, torch.full_like(confidence, float("-inf")))
    strategy = config.strategy
    if strategy == "sequential":
        commit[torch.nonzero(masked).flatten()[:quota]] = True
    elif strategy == "low_confidence_static":
        commit[top_by_confidence(conf, quota)] = True
    elif strategy == "low_confidence_dynamic":
        above = masked & (confidence > config.threshold)
        if int(above.sum()) >= quota:
            commit = above
        else:
            commit[top_by_confidence(conf, quota)] = True
    elif strategy == "threshold":
        if step >= steps - 1:
            return masked.clone()
        commit = masked & (confidence >= config.threshold)
        commit[top_by_confidence(conf, 1)] = True
    else:  # parse_options restricts strategy to STRATEGIES
        raise AssertionError(strategy)
    return commit


class StandardPolicy:
    """Computes the whole block every step; unmasks by one of ``STRATEGIES``."""

    name: ClassVar[str] = "standard"
    config_cls: ClassVar[type] = StandardPolicyConfig

    @staticmethod
    def choose_commits(confidence: torch.Tensor, masked: torch.Tensor, step: int,
                       block_size: int, config: StandardPolicyConfig) -> torch.Tensor:
        return choose_commits(confidence, masked, step, block_size, config)
