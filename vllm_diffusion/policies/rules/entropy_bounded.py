"""The ``entropy_bounded`` strategy: the EB-sampler (Ben-Hamu et al., arXiv 2505.24857,
Algorithm 1). A step commits the longest prefix of the masked positions, in
``entropy_bounded_order``, whose summed entropy minus its largest is at most
``entropy_bound`` (at least one); the orders and how they match the public
implementations: docs/policies.md, "standard". Entropy is of each proposal's distribution
(greedy: the softmax of its processed logits; sampled: the scaled, filtered one drawn
from). Plain reference of ``entropy_bounded_commits``: ``tests/reference_eb_sampler.py``.
"""

from __future__ import annotations

import torch

from vllm_diffusion.policies.rules.blocks import CommitRule, RuleBlocks

ENTROPY_BOUNDED_ORDERS = ("entropy", "confidence")


def entropy_bounded_order(confidence: torch.Tensor, masked: torch.Tensor,
                          entropy: torch.Tensor, by_confidence: torch.Tensor) -> torch.Tensor:
    """[R, B] int64: each block's positions in the order the strategy takes them, the
    masked ones first. confidence, entropy: [R, B] float; masked: [R, B] bool;
    by_confidence: [R] bool (else by entropy)."""
    key = torch.where(by_confidence[:, None], -confidence, entropy)  # ascending
    key = torch.where(masked, key, torch.full_like(key, float("inf")))
    return torch.sort(key, dim=1, stable=True).indices


def entropy_bounded_commits(confidence: torch.Tensor, masked: torch.Tensor,
                            entropy: torch.Tensor, entropy_bound: torch.Tensor,
                            by_confidence: torch.Tensor) -> torch.Tensor:
    """[R, B] bool: the masked positions each block commits by the EB-sampler's rule (at
    least one where any is masked).

    confidence, entropy: [R, B] float; masked: [R, B] bool; entropy_bound: [R] float;
    by_confidence: [R] bool, the blocks that order by confidence (the others by entropy).
    """
    order = entropy_bounded_order(confidence, masked, entropy, by_confidence)
    ordered = torch.where(masked, entropy, torch.zeros_like(entropy)).gather(1, order)
    # The summed entropy minus its running maximum never decreases along the order, so
    # the positions within the bound are a prefix.
    spread = ordered.cumsum(dim=1) - ordered.cummax(dim=1).values
    within = (spread <= entropy_bound[:, None]) & masked.gather(1, order)
    count = within.sum(dim=1, keepdim=True).clamp(min=1)  # [R, 1]
    taken = torch.arange(masked.shape[1]).expand_as(masked) < count  # in order
    return torch.zeros_like(masked).scatter(1, order, taken) & masked


class EntropyBounded(CommitRule):
    name = "entropy_bounded"

    def needs_entropy(self, config) -> bool:
        return True

    def step(self, blocks: RuleBlocks) -> torch.Tensor:
        if blocks.entropy is None:
            raise ValueError("the entropy_bounded strategy needs each proposal's entropy")
        commits = entropy_bounded_commits(
            blocks.confidence, blocks.candidates, blocks.entropy,
            blocks.option("entropy_bound"),
            torch.tensor([c.entropy_bounded_order == "confidence" for c in blocks.configs]))
        return torch.where(blocks.last_step, blocks.candidates, commits)
