"""What a policy decides for a step: the plan of each request's block (``BlockStepPlan``),
and, from the step's proposals for every denoised block (``StepBlocks``), what changes in
them (``StepDecision``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllm_diffusion.step.request import DiffusionRequest


@dataclasses.dataclass(frozen=True)
class BlockStepPlan:
    """One request's step, as its policy plans it (each None: the whole block)."""

    compute: torch.Tensor | None = None  # [B] bool: the block positions computed this step
    # how many block positions (from its start) the step's keys reach; positions past it
    # are neither computed nor attended to
    key_end: int | None = None
    # [B] bool: when the step commits the block just completed, its positions recomputed
    # (the others keep their cached KV); None: all of them, the exact commit
    commit_recompute: torch.Tensor | None = None


WHOLE_BLOCK = BlockStepPlan()


@dataclasses.dataclass
class StepBlocks:
    """Every denoised block of a step, stacked, as the policy's decision reads them (host
    tensors)."""

    requests: list[DiffusionRequest]
    confidence: torch.Tensor  # [R, B] float32 of each proposal, -inf where not proposed
    # [R, B] bool: masked positions computed through every layer with a usable proposal
    # (the only ones that may be unmasked)
    available: torch.Tensor
    proposals: torch.Tensor  # [R, B] int64 (any token where not computed)
    tokens: torch.Tensor  # [R, B] the blocks before the step
    # [R, B] bool: computed positions filled at an earlier step of the block (never prompt)
    filled: torch.Tensor
    # [R, B] float32 entropy of each proposal's distribution where a block's options ask
    # for it (``PolicyConfig.needs_entropy``)
    entropy: torch.Tensor | None = None
    # [R, B, r] each position's best tokens in order where the model's edits move tokens
    # (``DecodingPolicy.proposal_ranks``)
    ranked: torch.Tensor | None = None

    def rows(self, index: list[int]) -> "StepBlocks":
        """The blocks at ``index`` alone."""
        def pick(t):
            return None if t is None else t[index]
        return StepBlocks([self.requests[i] for i in index], self.confidence[index],
                          self.available[index], self.proposals[index], self.tokens[index],
                          self.filled[index], pick(self.entropy), pick(self.ranked))


@dataclasses.dataclass
class StepDecision:
    """What a policy's step decides for its R blocks; the runner applies it (within the
    requests' grammars and bad words)."""

    # [R, B] bool: masked positions unmasked, within ``available``, at least one per block
    # that has one unless ``idle``
    commits: torch.Tensor
    # [R, B] bool: filled positions that take their proposal (token editing); None: none
    edits: torch.Tensor | None = None
    # per block: its commit schedule unmasks nothing this step by design (Dream's
    # timesteps), so the step neither counts toward nor resets the no-progress limit
    idle: list[bool] | None = None
    # per block: None where its filled tokens are final (it ends when no mask is left),
    # else the most post steps (begun with no mask) it may edit before it ends
    # (``rules.token_editing.block_ends``); None for all: no block edits
    post_steps: list[int | None] | None = None
    # where the model's edits move tokens: each block's rewriting
    # (``rules.joint_editing.JointStep``) in place of commits and edits
    rewrites: list[Any] | None = None
    chunk: int | None = None  # the chunk size the policy chose for the step (a metric)

    def is_idle(self, i: int) -> bool:
        return self.idle is not None and self.idle[i]

    def post_steps_of(self, i: int) -> int | None:
        return None if self.post_steps is None else self.post_steps[i]

    @classmethod
    def nothing(cls, blocks: StepBlocks) -> "StepDecision":
        """No change to any of ``blocks`` (a request whose decision failed)."""
        return cls(torch.zeros_like(blocks.available))

    @classmethod
    def stack(cls, parts: list["StepDecision"]) -> "StepDecision":
        """One decision of the blocks of ``parts`` (each of one block), in order."""
        def firsts(name):  # each part's one value, None where it has none
            values = [getattr(p, name) for p in parts]
            return None if all(v is None for v in values) else [v[0] if v else None
                                                                for v in values]
        edits = None if all(p.edits is None for p in parts) else torch.cat(
            [torch.zeros_like(p.commits) if p.edits is None else p.edits for p in parts])
        idle = firsts("idle")
        return cls(torch.cat([p.commits for p in parts]), edits,
                   None if idle is None else [bool(v) for v in idle], firsts("post_steps"),
                   firsts("rewrites"), next((p.chunk for p in parts if p.chunk is not None), None))
