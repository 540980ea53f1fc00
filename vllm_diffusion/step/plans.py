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
    """One request's step, as its policy plans it.

    compute: [B] bool, the block positions computed this step (None: all of them);
    key_end: how many of the block's positions (from its start) this step's keys reach
        (None: the whole block); positions past it are neither computed nor attended to;
    commit_recompute: [B] bool, when the step commits the block the request just completed,
        its positions recomputed (the others keep their cached KV); None: all of them,
        the exact commit.
    """

    compute: torch.Tensor | None = None
    key_end: int | None = None
    commit_recompute: torch.Tensor | None = None


WHOLE_BLOCK = BlockStepPlan()


@dataclasses.dataclass
class StepBlocks:
    """Every denoised block of a step, stacked, as the policy's decision reads them (host
    tensors). confidence: [R, B] float32 of each proposal, -inf where not proposed;
    available: [R, B] bool, masked positions computed through every layer with a usable
    proposal (the only ones that may be unmasked); proposals: [R, B] int64 (any token where
    not computed); tokens: [R, B] the blocks before the step; filled: [R, B] bool, computed
    positions filled at an earlier step of the block (never prompt positions); entropy:
    [R, B] float32 of each proposal's distribution where a block's options ask for it
    (``PolicyConfig.needs_entropy``), else None; ranked: [R, B, r] each position's best
    tokens in order where the model's edits move tokens (``DecodingPolicy.proposal_ranks``),
    else None."""

    requests: list[DiffusionRequest]
    confidence: torch.Tensor
    available: torch.Tensor
    proposals: torch.Tensor
    tokens: torch.Tensor
    filled: torch.Tensor
    entropy: torch.Tensor | None = None
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
    requests' grammars and bad words).

    commits: [R, B] bool, masked positions unmasked (a subset of ``available`` with at least
        one position per block that has one, unless ``idle`` says otherwise);
    edits: [R, B] bool, filled positions that take their proposal (LLaDA2.1 token
        editing), or None: no edit;
    idle: per block, whether its commit schedule unmasks nothing this step by design
        (Dream's timesteps); such a step neither counts toward nor resets the engine's
        limit of steps without progress (None: no block is idle);
    post_steps: per block, None where its filled tokens are final (the block ends when no
        mask is left), else the most post steps (steps that begin with no mask) it may
        take to edit before it ends (``rules.token_editing.block_ends``); its tokens are
        then emitted when it ends (None for all: no block edits);
    rewrites: where the model's edits move tokens, each block's rewriting
        (``rules.joint_editing.JointStep``: the positions written, deletions, splits, the
        block after them, whether it ended) in place of commits and edits;
    chunk: the chunk size the step's requests compute, where the policy chooses one per
        step (exported as a metric).
    """

    commits: torch.Tensor
    edits: torch.Tensor | None = None
    idle: list[bool] | None = None
    post_steps: list[int | None] | None = None
    rewrites: list[Any] | None = None
    chunk: int | None = None

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
        def joined(name):
            values = [getattr(p, name) for p in parts]
            return None if all(v is None for v in values) else values
        edits = joined("edits")
        idle, post = joined("idle"), joined("post_steps")
        rewrites = joined("rewrites")
        return cls(
            torch.cat([p.commits for p in parts]),
            None if edits is None else torch.cat(
                [torch.zeros_like(p.commits) if p.edits is None else p.edits
                 for p in parts]),
            None if idle is None else [bool(v and v[0]) for v in idle],
            None if post is None else [v[0] if v else None for v in post],
            None if rewrites is None else [v[0] if v else None for v in rewrites],
            next((p.chunk for p in parts if p.chunk is not None), None))
