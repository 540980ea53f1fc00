"""Unmasking strategies: which masked positions of a block a step commits.

Following SDAR's published ``generate.py`` and LMDeploy:

- ``low_confidence_dynamic`` (SDAR): commit every masked position whose confidence is
  above ``threshold`` if there are at least the step's quota of them, else the top quota.
- ``low_confidence_static``: commit the top quota by confidence.
- ``sequential``: commit the leftmost quota of masked positions.
- ``threshold`` (LMDeploy / SGLang): commit the most confident masked position plus every
  masked position with confidence at least ``threshold``.
- ``entropy_bounded`` (EB-sampler, Ben-Hamu et al., arXiv 2505.24857): the masked
  positions in ``entropy_bounded_order`` (``entropy``: lowest first, the default, as the
  public implementations; ``confidence``: highest first), the longest prefix whose summed
  entropy, minus the largest entropy in it, is at most ``entropy_bound``; at least one
  position per step; see ``entropy_bounded.py``.
- ``timestep_schedule`` (Dream's ``diffusion_generate``): at step s of ``denoising_steps``
  (the published ``steps``), the top ``int(M * (1 - t_{s+1} / t_s))`` of the M masked
  positions over the timesteps ``linspace(1, eps, steps + 1)``, ranked by ``alg``
  (``maskgit_plus``: confidence; ``entropy``: negative entropy); see
  ``timestep_schedule.py``. Some of its steps commit nothing by design.

The quota of step ``s`` spreads the block over ``denoising_steps`` steps
(``B // steps`` plus one for the first ``B % steps`` steps), so every strategy finishes a
block within ``denoising_steps`` steps; ``threshold``, ``entropy_bounded`` and
``timestep_schedule`` commit everything left at their last allowed step.

``strategy_unmasking.StrategyUnmasking`` is the engine's decision by these (with LLaDA2.1
token editing), and ``strategy_unmasking.StrategyPolicy`` the base of the policies that
decide by it. The plain per-block reference of the batched choice
(``batched_commits.batched_choose_commits``) is ``tests/reference_unmasking.py``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from vllm_diffusion.options import OptionError, Rule, option
from vllm_diffusion.policies.base import PolicyConfig
from vllm_diffusion.policies.entropy_bounded import ENTROPY_BOUNDED_ORDERS
from vllm_diffusion.policies.timestep_schedule import SCHEDULE_RANKINGS, UNSERVED_ALGS

STRATEGIES = ("low_confidence_dynamic", "low_confidence_static", "sequential", "threshold",
              "entropy_bounded", "timestep_schedule", "factor")


@dataclasses.dataclass(frozen=True)
class StrategyConfig(PolicyConfig):
    """Options of the policies that unmask by one of ``STRATEGIES``."""

    engine_only: ClassVar[tuple[str, ...]] = ("max_post_steps_limit",
                                              "max_steps_per_block_limit")
    token_moving_options: ClassVar[tuple[str, ...]] = ("max_steps_per_block",)

    strategy: str = option("low_confidence_dynamic", Rule(str, choices=STRATEGIES))
    threshold: float = option(0.9, Rule(float, low=0.0, high=1.0))
    # ``factor`` (Fast-dLLM's dynamic rule): the masked position of confidence rank n
    # (1-based) commits while every rank up to it is at least 1 - factor / (n + 1)
    factor: float = option(1.0, Rule(float, low=0.0, high=1e6, low_inclusive=False))
    # gamma of ``entropy_bounded`` (nats); 0.1 as the public EB-sampler implementations
    # default to (the paper sweeps 1e-3 to 1)
    entropy_bound: float = option(0.1, Rule(float, low=0.0, high=1e6))
    # the order in which ``entropy_bounded`` takes the masked positions: lowest entropy
    # first (the public implementations'), or highest confidence first
    entropy_bounded_order: str = option("entropy", Rule(str, choices=ENTROPY_BOUNDED_ORDERS))
    # ``timestep_schedule`` (Dream's ``diffusion_generate``): the last of the timesteps
    # ``linspace(1, eps, steps + 1)``, and the published ``alg`` ranking the masks
    # (``maskgit_plus``, ``entropy``; ``topk_margin`` and ``origin`` are refused)
    eps: float = option(1e-3, Rule(float, low=0.0, high=1.0))
    alg: str = option("maskgit_plus", Rule(str, choices=(*SCHEDULE_RANKINGS,
                                                         *UNSERVED_ALGS)))
    # Sub-blocks of this many positions, decoded left to right (Fast-dLLM v2): a step
    # commits only in the leftmost sub-block still holding a computed mask; None: the
    # whole block at once. Must divide the block size.
    sub_block_size: int | None = option(None, Rule(int, low=1, high=1024, optional=True))
    # Cap on denoising steps per block; None means one step per block position.
    denoising_steps: int | None = option(None, Rule(int, low=1, high=4096, optional=True))
    # LLaDA2.1 token editing: a filled position of the current block takes the model's
    # token when it differs with probability above this (None: no editing).
    editing_threshold: float | None = option(None, Rule(float, low=0.0, high=1.0,
                                                        optional=True))
    # Steps a block may run with no mask left before it ends anyway (editing only).
    max_post_steps: int = option(16, Rule(int, low=0, high=4096))
    # Engine-wide: the largest 'max_post_steps' a request may ask for (each post step is
    # a forward of the block, so the option multiplies a request's work).
    max_post_steps_limit: int = option(64, Rule(int, low=0, high=4096))
    # Where tokens move (the rewriting loop): the hard cap on a block's denoising steps
    # (LLaDA2.2's published 1000), at most the
    # engine-wide 'max_steps_per_block_limit'.
    max_steps_per_block: int = option(1000, Rule(int, low=1, high=100000))
    max_steps_per_block_limit: int = option(1000, Rule(int, low=1, high=100000))

    def validate_for_block(self, block_size: int, source: str) -> None:
        if self.alg in UNSERVED_ALGS:
            raise OptionError(
                f"{source}: option 'alg' {self.alg!r} is not served: "
                f"{UNSERVED_ALGS[self.alg]}; use one of "
                f"{', '.join(map(repr, SCHEDULE_RANKINGS))}")
        if self.max_post_steps > self.max_post_steps_limit:
            raise OptionError(
                f"{source}: option 'max_post_steps' must be at most the engine's "
                f"'max_post_steps_limit' ({self.max_post_steps_limit}), got "
                f"{self.max_post_steps}")
        if self.max_steps_per_block > self.max_steps_per_block_limit:
            raise OptionError(
                f"{source}: option 'max_steps_per_block' must be at most the engine's "
                f"'max_steps_per_block_limit' ({self.max_steps_per_block_limit}), got "
                f"{self.max_steps_per_block}")
        if self.sub_block_size is not None and block_size % self.sub_block_size:
            raise OptionError(
                f"{source}: option 'sub_block_size' must divide the block size "
                f"({block_size}), got {self.sub_block_size}")
        if self.denoising_steps is not None and self.denoising_steps > block_size:
            raise OptionError(
                f"{source}: option 'denoising_steps' must be at most the block size "
                f"({block_size}), got {self.denoising_steps}"
            )

    def refuse_editing_with(self, source: str, reason: str) -> None:
        """Raise if editing is on: ``reason`` says why this configuration cannot honour it."""
        if self.editing_threshold is not None:
            raise OptionError(f"{source}: option 'editing_threshold' cannot apply {reason}")

    def steps_for(self, block_size: int) -> int:
        return self.denoising_steps or block_size


def step_quota(block_size: int, steps: int, step: int) -> int:
    """Positions to commit at denoising step ``step`` of a block (SDAR's schedule)."""
    if step >= steps:
        return block_size
    return block_size // steps + (1 if step < block_size % steps else 0)
