"""The decision by the unmasking rules of ``policies/rules/`` (``StrategyUnmasking``) and
the base of the policies that decide by it (``StrategyPolicy``).

``StrategyUnmasking`` commits by the request's ``strategy`` (its rule), edits filled
tokens where a request asks for LLaDA2.1 token editing (``editing_threshold``), and,
where the served model's edits move tokens, rewrites each block by the joint loop of
``rules/joint_editing.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

import torch

from vllm_diffusion.capabilities import ModelCapabilities, PolicyTraits
from vllm_diffusion.policies.base import BlockUnmasking, DecodingPolicy
from vllm_diffusion.policies import rules
from vllm_diffusion.policies.rules.joint_editing import (ALTERNATIVES, EditTokens,
                                                         JointBlockState, JointStep, joint_step)
from vllm_diffusion.policies.parts.strategy_config import StrategyConfig
from vllm_diffusion.step.plans import CommitBatch, EditBatch
from vllm_diffusion.step.request import DiffusionRequest

StrategyRequest = DiffusionRequest[StrategyConfig, Any]


class StrategyUnmasking(BlockUnmasking[StrategyConfig, Any]):
    """Commits by the blocks' rules (``rules.RULES``, batched over the step's blocks),
    with LLaDA2.1 token editing where a request asks for it, and the rewriting loop where
    the model's edits move tokens."""

    def __init__(self, block_size: int, mask_token_id: int,
                 model: ModelCapabilities) -> None:
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.model = model  # the served model's capabilities

    def ranked_proposals(self) -> int:
        return ALTERNATIVES if self.model.moves_tokens else 0

    def rewrite_block(self, request: StrategyRequest, old: torch.Tensor,
                      proposals: torch.Tensor, confidence: torch.Tensor,
                      ranked: torch.Tensor) -> JointStep:
        canvas, config = request.canvas, request.policy_config
        if canvas.rewrite_state is None:
            canvas.rewrite_state = JointBlockState.start(canvas.tokens, self.mask_token_id,
                                                 config.steps_for(self.block_size))
        return joint_step(canvas.rewrite_state, old, proposals, confidence, ranked, canvas.steps,
                          config, self.mask_token_id, EditTokens(*self.model.edit_tokens))

    def edits_tokens(self, request: StrategyRequest) -> bool:
        return (self.model.moves_tokens
                or request.policy_config.editing_threshold is not None)

    def choose_edits(self, batch: EditBatch) -> torch.Tensor | None:
        limits = [r.policy_config.editing_threshold for r in batch.requests]
        if all(limit is None for limit in limits):
            return None
        limit = torch.tensor([float("inf") if x is None else x for x in limits])
        return (batch.filled & (batch.proposals != batch.tokens)
                & (batch.confidence > limit[:, None]))

    def block_ends(self, request: StrategyRequest, edited: bool,
                   began_unmasked: bool) -> bool:
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

    def wants_entropy(self, requests: list[StrategyRequest]) -> bool:
        return rules.needs_entropy([r.policy_config for r in requests])

    def choose_commits(self, batch: CommitBatch) -> torch.Tensor:
        return rules.choose_commits(self._rule_blocks(batch))

    def scheduled_idle(self, batch: CommitBatch) -> list[bool]:
        """Blocks whose rule's schedule commits nothing this step by design
        (``CommitRule.idle``: Dream's timesteps)."""
        if not any(r.policy_config.strategy in rules.SCHEDULED for r in batch.requests):
            return [False] * len(batch.requests)  # the common step: nothing built
        return rules.scheduled_idle(self._rule_blocks(batch))

    def _rule_blocks(self, batch: CommitBatch) -> rules.RuleBlocks:
        """The step's blocks as the rules see them: each block's candidates are its
        computed masks, within its active sub-block where ``sub_block_size`` is set."""
        configs = [r.policy_config for r in batch.requests]
        sizes = [c.sub_block_size for c in configs]
        candidates = batch.masked
        if any(size is not None for size in sizes):
            candidates = _active_sub_block(batch.masked, torch.tensor(
                [self.block_size if size is None else size for size in sizes],
                dtype=torch.long))
        return rules.RuleBlocks(batch.confidence, candidates,
                                [r.canvas.steps for r in batch.requests],
                                [c.steps_for(self.block_size) for c in configs], configs,
                                batch.entropy)


def _active_sub_block(masked: torch.Tensor, sub_block_size: torch.Tensor) -> torch.Tensor:
    """[R, B] bool: the masked positions in each block's leftmost sub-block holding one
    (``masked`` [R, B] bool; ``sub_block_size`` [R] int64, the block size where a block
    has no sub-blocks). A block with no masked position keeps none."""
    block = masked.shape[1]
    positions = torch.arange(block)
    first = torch.where(masked, positions, block).min(dim=1).values  # [R]
    sub_block = positions[None, :] // sub_block_size[:, None]  # [R, B]
    return masked & (sub_block == (first // sub_block_size)[:, None])


StrategyConfigT = TypeVar("StrategyConfigT", bound=StrategyConfig)
StateT = TypeVar("StateT")


class StrategyPolicy(DecodingPolicy[StrategyConfigT, StateT],
                     Generic[StrategyConfigT, StateT]):
    """Base of the policies that decide by ``StrategyUnmasking`` (what to compute is each
    policy's own)."""

    @classmethod
    def traits(cls, options: Mapping[str, Any]) -> PolicyTraits:
        """Blocks whose tokens move decode by the rewriting loop (``joint_editing``),
        which unmasks by its own rule."""
        strategy = options.get("strategy", "low_confidence_dynamic")
        return dataclasses.replace(super().traits(options), fixed_positions_only=(
            None if strategy == "low_confidence_dynamic" else
            "option 'strategy': the rewriting loop unmasks by its own rule (its threshold "
            "and quota schedule); remove it"))

    def make_unmasking(self) -> StrategyUnmasking:
        return StrategyUnmasking(self.block_size, self.mask_token_id, self.model)
