"""What a policy decides for a step: the plan of each request's block, and the batched
commit and edit choices over every denoised block."""

from __future__ import annotations

import dataclasses

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
class CommitBatch:
    """Every denoised block of a step, stacked. confidence: [R, B] float32 (host) of each
    proposal, -inf where not proposed; masked: [R, B] bool, masked positions that were
    computed through every layer (the only ones that may be chosen); entropy: [R, B]
    float32 (host) of each proposal's distribution, where the policy asked for it
    (``BlockUnmasking.wants_entropy``), else None."""

    requests: list[DiffusionRequest]
    confidence: torch.Tensor
    masked: torch.Tensor
    entropy: torch.Tensor | None = None


@dataclasses.dataclass
class EditBatch:
    """Every denoised block of a step, for token editing: confidence [R, B] float32 and
    proposals [R, B] int64 (host) of each computed position (-inf / any token elsewhere),
    tokens [R, B] the blocks before the step, filled [R, B] bool the computed positions
    filled at an earlier step of the block (never prompt positions)."""

    requests: list[DiffusionRequest]
    confidence: torch.Tensor
    proposals: torch.Tensor
    tokens: torch.Tensor
    filled: torch.Tensor
