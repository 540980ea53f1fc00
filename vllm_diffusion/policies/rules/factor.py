"""``factor`` (Fast-dLLM's dynamic rule, ``get_transfer_index_dynamic``, NVlabs/Fast-dLLM
f6b35ec): the candidate of confidence rank n (1-based) commits while every rank up to it
is at least ``1 - factor / (n + 1)``; at the block's last allowed step, every candidate."""

from __future__ import annotations

import torch

from vllm_diffusion.policies.rules.blocks import CommitRule, RuleBlocks


def batched_factor_count(ranked: torch.Tensor, num_masked: torch.Tensor,
                         factor: torch.Tensor) -> torch.Tensor:
    """How many candidates the rule commits, for R blocks: the ranks before the first rank
    n (1-based) whose confidence is below 1 - factor / (n + 1) (the first rank always
    passes), except that a failure at the last rank, or none, commits all. ranked [R, B]
    confidences in descending order (candidates first), num_masked [R], factor [R]
    float; returns [R] int64."""
    block = ranked.shape[1]
    index = torch.arange(block)
    bar = 1.0 - factor.double()[:, None] / (index[None, :] + 2)  # [R, B]
    fails = ((ranked.double() < bar) & (index[None, :] >= 1)
             & (index[None, :] < num_masked[:, None]))  # [R, B]
    first = torch.where(fails, index[None, :], block).min(dim=1).values  # [R]
    return torch.where(first >= num_masked - 1, num_masked, first)


class Factor(CommitRule):
    name = "factor"

    def step(self, blocks: RuleBlocks) -> torch.Tensor:
        order, rank = blocks.ranked
        count = batched_factor_count(blocks.masked_confidence.gather(1, order),
                                     blocks.num_masked,
                                     blocks.option("factor", torch.float64))[:, None]
        return torch.where(blocks.last_step, blocks.candidates,
                           (rank < count) & blocks.candidates)
