"""The decision by the unmasking strategies of ``unmasking.py`` (``StrategyUnmasking``) and
the base of the policies that decide by it (``StrategyPolicy``).

``StrategyUnmasking`` commits by the request's ``strategy``, edits filled tokens where a
request asks for LLaDA2.1 token editing (``editing_threshold``), and, where the served
model's edits move tokens, rewrites each block by the joint loop of ``joint_editing.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

import torch

from vllm_diffusion.capabilities import ModelCapabilities, PolicyTraits
from vllm_diffusion.policies.base import BlockUnmasking, DecodingPolicy
from vllm_diffusion.policies.joint_editing import (ALTERNATIVES, EditTokens, JointBlockState,
                                                   JointStep, joint_step)
from vllm_diffusion.policies.timestep_schedule import (SCHEDULE_RANKINGS,
                                                       batched_timestep_quota)
from vllm_diffusion.policies.batched_commits import active_sub_block, batched_choose_commits
from vllm_diffusion.policies.host_commits import (HOST_STRATEGIES, MAX_HOST_POSITIONS,
                                                  as_float32, host_choose_commits)
from vllm_diffusion.policies.unmasking import STRATEGIES, StrategyConfig
from vllm_diffusion.step.plans import CommitBatch, EditBatch
from vllm_diffusion.step.request import DiffusionRequest

StrategyRequest = DiffusionRequest[StrategyConfig, Any]


class StrategyUnmasking(BlockUnmasking[StrategyConfig, Any]):
    """Commits by one of ``STRATEGIES`` (batched over the step's blocks), with LLaDA2.1
    token editing where a request asks for it, and the rewriting loop where the model's
    edits move tokens."""

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
        return any(_ranks_by_entropy(r.policy_config) for r in requests)

    def choose_commits(self, batch: CommitBatch) -> torch.Tensor:
        configs = [r.policy_config for r in batch.requests]
        if (configs and batch.confidence.numel() <= MAX_HOST_POSITIONS
                and all(c.strategy in HOST_STRATEGIES for c in configs)):
            # a small step of the threshold and quota strategies: decided on the host
            return torch.tensor(host_choose_commits(
                batch.confidence.tolist(), self._candidates(batch).tolist(),
                [r.canvas.steps for r in batch.requests],
                [c.steps_for(self.block_size) for c in configs],
                [c.strategy for c in configs], [as_float32(c.threshold) for c in configs]),
                dtype=torch.bool)
        codes = _strategy_codes(batch)
        # a strategy's own options only where a block follows it (not on every step)
        followed = {c.strategy for c in configs}
        scheduled = "timestep_schedule" in followed
        bounded = "entropy_bounded" in followed
        by_factor = "factor" in followed
        return batched_choose_commits(
            batch.confidence, self._candidates(batch), self._steps_taken(batch),
            self._steps_allowed(batch), codes,
            torch.tensor([c.threshold for c in configs], dtype=torch.float32),
            batch.entropy,
            torch.tensor([c.entropy_bound for c in configs], dtype=torch.float32)
            if bounded else None,
            _eps(batch) if scheduled else None,
            torch.tensor([SCHEDULE_RANKINGS.index(c.alg) for c in configs],
                         dtype=torch.long) if scheduled else None,
            torch.tensor([c.entropy_bounded_order == "confidence" for c in configs])
            if bounded else None,
            torch.tensor([c.factor for c in configs], dtype=torch.float64)
            if by_factor else None)

    def scheduled_idle(self, batch: CommitBatch) -> list[bool]:
        """Blocks under ``timestep_schedule`` whose quota this step is 0 before their last
        step, with masked positions to choose from (``timestep_schedule.py``)."""
        if not any(r.policy_config.strategy == "timestep_schedule" for r in batch.requests):
            return [False] * len(batch.requests)  # the common step: no tensors built
        scheduled = _strategy_codes(batch) == STRATEGIES.index("timestep_schedule")
        num_masked = self._candidates(batch).sum(dim=1)
        quota = batched_timestep_quota(num_masked, self._steps_taken(batch),
                                       self._steps_allowed(batch), _eps(batch), scheduled)
        return (scheduled & (num_masked > 0) & (quota == 0)).tolist()

    def _candidates(self, batch: CommitBatch) -> torch.Tensor:
        """[R, B] bool: the masked positions a step may commit: each block's computed
        masks, within its active sub-block where ``sub_block_size`` is set."""
        sizes = [r.policy_config.sub_block_size for r in batch.requests]
        if all(size is None for size in sizes):
            return batch.masked
        return active_sub_block(batch.masked, torch.tensor(
            [self.block_size if size is None else size for size in sizes], dtype=torch.long))

    def _steps_taken(self, batch: CommitBatch) -> torch.Tensor:
        """[R] int64: each block's denoising steps before this one."""
        return torch.tensor([r.canvas.steps for r in batch.requests], dtype=torch.long)

    def _steps_allowed(self, batch: CommitBatch) -> torch.Tensor:
        """[R] int64: each block's ``denoising_steps``."""
        return torch.tensor([r.policy_config.steps_for(self.block_size)
                             for r in batch.requests], dtype=torch.long)


def _ranks_by_entropy(config: StrategyConfig) -> bool:
    return (config.strategy == "entropy_bounded"
            or (config.strategy == "timestep_schedule" and config.alg == "entropy"))


def _strategy_codes(batch: CommitBatch) -> torch.Tensor:
    """[R] int64: each block's strategy, an index into ``STRATEGIES``."""
    return torch.tensor([STRATEGIES.index(r.policy_config.strategy) for r in batch.requests],
                        dtype=torch.long)


def _eps(batch: CommitBatch) -> torch.Tensor:
    """[R] float64: each block's ``eps``, exactly as the option holds it."""
    return torch.tensor([r.policy_config.eps for r in batch.requests], dtype=torch.float64)


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
