"""Unmasking strategies: which masked positions of a block a step commits.

Following SDAR's published ``generate.py`` and LMDeploy:

- ``low_confidence_dynamic`` (SDAR): commit every masked position whose confidence is
  above ``threshold`` if there are at least the step's quota of them, else the top quota.
- ``low_confidence_static``: commit the top quota by confidence.
- ``sequential``: commit the leftmost quota of masked positions.
- ``threshold`` (LMDeploy / SGLang): commit the most confident masked position plus every
  masked position with confidence at least ``threshold``.
- ``entropy_bounded`` (EB-sampler, Ben-Hamu et al., arXiv 2505.24857): order the masked
  positions by confidence and commit the longest prefix of that order whose summed
  entropy, minus the largest entropy in it, is at most ``entropy_bound``; at least one
  position per step. Entropy: of each position's proposal distribution (greedy: the
  softmax of its processed logits; sampled: the scaled, filtered distribution drawn
  from).

The quota of step ``s`` spreads the block over ``denoising_steps`` steps
(``B // steps`` plus one for the first ``B % steps`` steps), so every strategy finishes a
block within ``denoising_steps`` steps; ``threshold`` and ``entropy_bounded`` commit everything left at
their last allowed step.

``StrategyPolicy`` is the base of the policies that unmask by one of these (the commit
choice and LLaDA2.1 token editing; what to compute is each policy's own).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, Generic, TypeVar

import torch

from vllm_diffusion.capabilities import PolicyTraits
from vllm_diffusion.options import OptionError, Rule, option
from vllm_diffusion.policies.base import DecodingPolicy, PolicyConfig
from vllm_diffusion.policies.joint_editing import (ALTERNATIVES, EditTokens, JointBlockState,
                                                   JointStep, joint_step)
from vllm_diffusion.step.plans import CommitBatch, EditBatch
from vllm_diffusion.step.request import DiffusionRequest

STRATEGIES = ("low_confidence_dynamic", "low_confidence_static", "sequential", "threshold",
              "entropy_bounded")


@dataclasses.dataclass(frozen=True)
class StrategyConfig(PolicyConfig):
    """Options of the policies that unmask by one of ``STRATEGIES``."""

    engine_only: ClassVar[tuple[str, ...]] = ("max_post_steps_limit",
                                              "max_steps_per_block_limit")
    token_moving_options: ClassVar[tuple[str, ...]] = ("max_steps_per_block",)

    strategy: str = option("low_confidence_dynamic", Rule(str, choices=STRATEGIES))
    threshold: float = option(0.9, Rule(float, low=0.0, high=1.0))
    # gamma of ``entropy_bounded`` (nats); 0.1 as the public EB-sampler implementations
    # default to (the paper sweeps 1e-3 to 1)
    entropy_bound: float = option(0.1, Rule(float, low=0.0, high=1e6))
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


def top_by_confidence(confidence: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest confidences; ties go to the lower position."""
    order = torch.sort(confidence, descending=True, stable=True).indices
    return order[:k]


def choose_commits(confidence: torch.Tensor, masked: torch.Tensor, step: int,
                   block_size: int, config: StrategyConfig,
                   entropy: torch.Tensor | None = None) -> torch.Tensor:
    """Which positions of one block to commit this step (the plain reference of
    ``batched_choose_commits``).

    confidence: [B] float, the probability of each position's proposed token.
    masked:     [B] bool, positions still holding the mask token.
    entropy:    [B] float, each position's proposal entropy (``entropy_bounded`` only).
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
    elif strategy == "entropy_bounded":
        if step >= steps - 1:
            return masked.clone()
        order = top_by_confidence(conf, num_masked).tolist()
        total = largest = 0.0
        count = 0
        for position in order:
            total += float(entropy[position])
            largest = max(largest, float(entropy[position]))
            if count and total - largest > config.entropy_bound:
                break
            count += 1
        commit[order[:count]] = True
    else:  # parse_options restricts strategy to STRATEGIES
        raise AssertionError(strategy)
    return commit


def batched_choose_commits(confidence: torch.Tensor, masked: torch.Tensor,
                           steps_taken: torch.Tensor, steps_allowed: torch.Tensor,
                           strategy: torch.Tensor, threshold: torch.Tensor,
                           entropy: torch.Tensor | None = None,
                           entropy_bound: torch.Tensor | None = None) -> torch.Tensor:
    """``choose_commits`` for R blocks at once (the engine's path; tested against it).

    confidence, masked: [R, B]; steps_taken (the block's step), steps_allowed (its
    ``steps_for``), strategy (index into ``STRATEGIES``): [R] int64; threshold: [R] float;
    entropy: [R, B] and entropy_bound: [R] float (needed where a block uses
    ``entropy_bounded``).
    """
    num_rows, block = masked.shape
    num_masked = masked.sum(dim=1)
    base, extra = block // steps_allowed, block % steps_allowed
    quota = torch.where(steps_taken >= steps_allowed, torch.full_like(base, block),
                        base + (steps_taken < extra).long())
    quota = torch.minimum(quota, num_masked)[:, None]  # [R, 1]
    conf = torch.where(masked, confidence, torch.full_like(confidence, float("-inf")))
    order = torch.sort(conf, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(
        1, order, torch.arange(block).expand(num_rows, block).contiguous())
    top = (rank < quota) & masked
    sequential = masked & (masked.cumsum(dim=1) <= quota)
    above = masked & (confidence > threshold[:, None])
    dynamic = torch.where((above.sum(dim=1, keepdim=True) >= quota), above, top)
    last_step = (steps_taken >= steps_allowed - 1)[:, None]
    by_threshold = torch.where(
        last_step, masked, (masked & (confidence >= threshold[:, None])) | ((rank < 1) & masked))
    if entropy is None:
        if bool((strategy == STRATEGIES.index("entropy_bounded")).any()):
            raise ValueError("the entropy_bounded strategy needs each proposal's entropy")
        entropy_bounded = torch.zeros_like(masked)
    else:
        # Masked positions by confidence: the summed entropy minus its running maximum
        # never decreases along the order, so the positions within the bound are a prefix.
        ordered = torch.where(masked, entropy, torch.zeros_like(entropy)).gather(1, order)
        spread = ordered.cumsum(dim=1) - ordered.cummax(dim=1).values
        within = (spread <= entropy_bound[:, None]) & masked.gather(1, order)
        count = within.sum(dim=1, keepdim=True).clamp(min=1)
        entropy_bounded = torch.where(last_step, masked, (rank < count) & masked)
    choices = torch.stack([dynamic, top, sequential, by_threshold,
                           entropy_bounded])  # STRATEGIES order
    return choices[strategy, torch.arange(num_rows)]


StrategyConfigT = TypeVar("StrategyConfigT", bound=StrategyConfig)
StateT = TypeVar("StateT")


class StrategyPolicy(DecodingPolicy[StrategyConfigT, StateT],
                     Generic[StrategyConfigT, StateT]):
    """Base of the policies that unmask by one of ``STRATEGIES`` (the commit choice only;
    what to compute is each policy's own), with LLaDA2.1 token editing where a request
    asks for it (``editing_threshold``)."""

    @classmethod
    def traits(cls, options: Mapping[str, Any]) -> PolicyTraits:
        """Blocks whose tokens move decode by the rewriting loop (``joint_editing``),
        which unmasks by its own rule."""
        strategy = options.get("strategy", "low_confidence_dynamic")
        return dataclasses.replace(super().traits(options), fixed_positions_only=(
            None if strategy == "low_confidence_dynamic" else
            "option 'strategy': the rewriting loop unmasks by its own rule (its threshold "
            "and quota schedule); remove it"))

    def ranked_proposals(self) -> int:
        return ALTERNATIVES if self.model.moves_tokens else 0

    def rewrite_block(self, request: DiffusionRequest[StrategyConfigT, StateT],
                      old: torch.Tensor, proposals: torch.Tensor, confidence: torch.Tensor,
                      ranked: torch.Tensor) -> JointStep:
        canvas, config = request.canvas, request.policy_config
        if canvas.rewrite_state is None:
            canvas.rewrite_state = JointBlockState.start(canvas.tokens, self.mask_token_id,
                                                 config.steps_for(self.block_size))
        return joint_step(canvas.rewrite_state, old, proposals, confidence, ranked, canvas.steps,
                          config, self.mask_token_id, EditTokens(*self.model.edit_tokens))

    def edits_tokens(self, request: DiffusionRequest[StrategyConfigT, StateT]) -> bool:
        return (self.model.moves_tokens
                or request.policy_config.editing_threshold is not None)

    def choose_edits(self, batch: EditBatch) -> torch.Tensor | None:
        limits = [r.policy_config.editing_threshold for r in batch.requests]
        if all(limit is None for limit in limits):
            return None
        limit = torch.tensor([float("inf") if x is None else x for x in limits])
        return (batch.filled & (batch.proposals != batch.tokens)
                & (batch.confidence > limit[:, None]))

    def block_ends(self, request: DiffusionRequest[StrategyConfigT, StateT],
                   edited: bool, began_unmasked: bool) -> bool:
        """Without editing, as soon as no mask is left. With editing, as LLaDA2.1's loop,
        which looks for masks at the start of each step: the step that fills the block's
        last mask is followed by post steps (steps that begin with no mask), and the block
        ends after a post step that edits nothing or after ``max_post_steps`` of them
        (with 0, right after the last mask is filled)."""
        config = request.policy_config
        if config.editing_threshold is None:
            return True
        if not began_unmasked:
            return config.max_post_steps == 0
        return not edited or request.canvas.post_steps >= config.max_post_steps

    def wants_entropy(self, requests: list[DiffusionRequest[StrategyConfigT, StateT]]) -> bool:
        return any(r.policy_config.strategy == "entropy_bounded" for r in requests)

    def choose_commits(self, batch: CommitBatch) -> torch.Tensor:
        configs = [r.policy_config for r in batch.requests]
        return batched_choose_commits(
            batch.confidence, batch.masked,
            torch.tensor([r.canvas.steps for r in batch.requests], dtype=torch.long),
            torch.tensor([c.steps_for(self.block_size) for c in configs], dtype=torch.long),
            torch.tensor([STRATEGIES.index(c.strategy) for c in configs], dtype=torch.long),
            torch.tensor([c.threshold for c in configs], dtype=torch.float32),
            batch.entropy,
            torch.tensor([c.entropy_bound for c in configs], dtype=torch.float32))
