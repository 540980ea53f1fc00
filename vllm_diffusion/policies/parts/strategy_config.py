"""``StrategyConfig``: the options of the policies that unmask by the rules of ``rules/``
(the rule, each rule's own options, sub-blocks, steps per block, token editing)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from vllm_diffusion.capabilities import PolicyTraits
from vllm_diffusion.options import OptionError, Rule, option
from vllm_diffusion.policies.base import PolicyConfig
from vllm_diffusion.policies.rules import RULES
from vllm_diffusion.policies.rules.entropy_bounded import ENTROPY_BOUNDED_ORDERS
from vllm_diffusion.policies.rules.timestep_schedule import SCHEDULE_RANKINGS, UNSERVED_ALGS

STRATEGIES = tuple(RULES)  # the rules' names, the ``strategy`` option's values


@dataclasses.dataclass(frozen=True)
class StrategyConfig(PolicyConfig):
    """Options of the policies that unmask by one of ``STRATEGIES``."""

    engine_only: ClassVar[tuple[str, ...]] = ("max_post_steps_limit",
                                              "max_steps_per_block_limit")
    token_moving_options: ClassVar[tuple[str, ...]] = ("max_steps_per_block",)

    strategy: str = option("low_confidence_dynamic", Rule(str, choices=STRATEGIES))
    threshold: float = option(0.9, Rule(float, low=0.0, high=1.0))
    # ``factor`` (Fast-dLLM's dynamic rule): rank n commits while every rank up to it is
    # at least 1 - factor / (n + 1)
    factor: float = option(1.0, Rule(float, low=0.0, high=1e6, low_inclusive=False))
    # gamma of ``entropy_bounded`` (nats); 0.1 as the public EB-sampler implementations
    # default to (the paper sweeps 1e-3 to 1)
    entropy_bound: float = option(0.1, Rule(float, low=0.0, high=1e6))
    # lowest entropy first (the public implementations'), or highest confidence first
    entropy_bounded_order: str = option("entropy", Rule(str, choices=ENTROPY_BOUNDED_ORDERS))
    # ``timestep_schedule``: the last of the timesteps ``linspace(1, eps, steps + 1)``, and
    # the published ``alg`` ranking the masks (``UNSERVED_ALGS`` refused)
    eps: float = option(1e-3, Rule(float, low=0.0, high=1.0))
    alg: str = option("maskgit_plus", Rule(str, choices=(*SCHEDULE_RANKINGS,
                                                         *UNSERVED_ALGS)))
    # Sub-blocks decoded left to right (Fast-dLLM v2): a step commits only in the leftmost
    # one still holding a computed mask; None: the whole block at once.
    sub_block_size: int | None = option(None, Rule(int, low=1, high=1024, optional=True))
    # Cap on denoising steps per block; None means one step per block position.
    denoising_steps: int | None = option(None, Rule(int, low=1, high=4096, optional=True))
    # LLaDA2.1 token editing: a filled position of the current block takes the model's
    # token when it differs with probability above this (None: no editing).
    editing_threshold: float | None = option(None, Rule(float, low=0.0, high=1.0,
                                                        optional=True))
    # Steps a block may run with no mask left before it ends anyway (editing only).
    max_post_steps: int = option(16, Rule(int, low=0, high=4096))
    # Engine-wide: the largest 'max_post_steps' a request may ask for (each is a forward).
    max_post_steps_limit: int = option(64, Rule(int, low=0, high=4096))
    # Where tokens move (the rewriting loop): the hard cap on a block's denoising steps
    # (LLaDA2.2's published 1000), at most the engine-wide 'max_steps_per_block_limit'.
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
                f"({block_size}), got {self.denoising_steps}")

    def refuse_editing_with(self, source: str, reason: str) -> None:
        """Raise if editing is on: ``reason`` says why this configuration cannot honour it."""
        if self.editing_threshold is not None:
            raise OptionError(f"{source}: option 'editing_threshold' cannot apply {reason}")

    def steps_for(self, block_size: int) -> int:
        return self.denoising_steps or block_size

    @property
    def needs_entropy(self) -> bool:
        return RULES[self.strategy].needs_entropy(self)

    @classmethod
    def traits(cls, options: Mapping[str, Any]) -> PolicyTraits:
        """Blocks whose tokens move decode by the rewriting loop (``joint_editing``),
        which unmasks by its own rule."""
        strategy = options.get("strategy", "low_confidence_dynamic")
        return dataclasses.replace(super().traits(options), fixed_positions_only=(
            None if strategy == "low_confidence_dynamic" else
            "option 'strategy': the rewriting loop unmasks by its own rule (its threshold "
            "and quota schedule); remove it"))
