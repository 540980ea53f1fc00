"""The decision by the unmasking rules of ``policies/rules/`` (``strategy_decision``: each
block's rule's commits, LLaDA2.1's token edits, or the joint loop where the model's edits
move tokens) and the base of the policies that decide by it (``StrategyPolicy``)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import torch

from vllm_diffusion.capabilities import ModelCapabilities
from vllm_diffusion.policies.base import DecodingPolicy
from vllm_diffusion.policies import rules
from vllm_diffusion.policies.rules import token_editing
from vllm_diffusion.policies.rules.joint_editing import (ALTERNATIVES, EditTokens,
                                                         JointBlockState, joint_step)
from vllm_diffusion.policies.parts.strategy_config import StrategyConfig
from vllm_diffusion.step.plans import StepBlocks, StepDecision


def strategy_decision(blocks: StepBlocks, block_size: int, mask_token_id: int,
                      model: ModelCapabilities) -> StepDecision:
    """The step's decision for ``blocks`` by their options: each block's rule's commits
    (within its active sub-block where ``sub_block_size`` is set), its token edits, or,
    where the model's edits move tokens, its rewriting."""
    if model.moves_tokens:
        return _rewrites(blocks, block_size, mask_token_id, model)
    configs = [r.policy_config for r in blocks.requests]
    rule_blocks = _rule_blocks(blocks, configs, block_size)
    commits = rules.choose_commits(rule_blocks)
    idle = (rules.scheduled_idle(rule_blocks)
            if any(c.strategy in rules.SCHEDULED for c in configs) else None)
    edits, post_steps = token_editing.choose_edits(
        configs, blocks.confidence, blocks.proposals, blocks.tokens, blocks.filled)
    return StepDecision(commits, edits, idle, post_steps)


def _rewrites(blocks: StepBlocks, block_size: int, mask_token_id: int,
              model: ModelCapabilities) -> StepDecision:
    """One step of the joint loop on each block (each a ``JointStep``). The blocks' loop
    states are replaced only once every block's step succeeded, so that a step asked again
    block by block (after one of them raised) does not advance a block twice."""
    edit = EditTokens(*model.edit_tokens)
    states, rewrites = [], []
    for i, request in enumerate(blocks.requests):
        canvas, config = request.canvas, request.policy_config
        state = canvas.rewrite_state
        state = (JointBlockState.start(canvas.tokens, mask_token_id,
                                       config.steps_for(block_size)) if state is None
                 else state.copy())
        rewrites.append(joint_step(state, blocks.tokens[i], blocks.proposals[i],
                                   blocks.confidence[i], blocks.ranked[i], canvas.steps,
                                   config, mask_token_id, edit))
        states.append(state)
    for request, state in zip(blocks.requests, states):
        request.canvas.rewrite_state = state
    return StepDecision(torch.zeros_like(blocks.available), rewrites=rewrites)


def _rule_blocks(blocks: StepBlocks, configs: list[StrategyConfig],
                 block_size: int) -> rules.RuleBlocks:
    """The step's blocks as the rules see them: each block's candidates are its available
    masks, within its active sub-block where ``sub_block_size`` is set."""
    sizes = [c.sub_block_size for c in configs]
    candidates = blocks.available
    if any(size is not None for size in sizes):
        candidates = _active_sub_block(blocks.available, torch.tensor(
            [block_size if size is None else size for size in sizes], dtype=torch.long))
    return rules.RuleBlocks(blocks.confidence, candidates,
                            [r.canvas.steps for r in blocks.requests],
                            [c.steps_for(block_size) for c in configs], configs,
                            blocks.entropy)


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
    """Base of the policies that decide by the rules (``strategy_decision``; what to
    compute is each policy's own)."""

    def bind(self, model: ModelCapabilities, hf_config: Any, prefix_caching: bool) -> None:
        super().bind(model, hf_config, prefix_caching)
        self.proposal_ranks = ALTERNATIVES if model.moves_tokens else 0

    def decide(self, blocks: StepBlocks) -> StepDecision:
        return strategy_decision(blocks, self.block_size, self.mask_token_id, self.model)
