"""The engine's commit choice: the unmasking strategies (``unmasking.py``) for R blocks at
once, each block by its own strategy; only the strategies some block follows are computed
(tested against the per-block reference, ``tests/reference_unmasking.py``, on a named
grid, every strategy mixed and each alone).
"""

from __future__ import annotations

import functools

import torch

from vllm_diffusion.policies.entropy_bounded import entropy_bounded_commits
from vllm_diffusion.policies.timestep_schedule import batched_timestep_quota, schedule_score
from vllm_diffusion.policies.unmasking import STRATEGIES


def batched_factor_count(ranked: torch.Tensor, num_masked: torch.Tensor,
                         factor: torch.Tensor) -> torch.Tensor:
    """How many masked positions Fast-dLLM's dynamic rule (``get_transfer_index_dynamic``,
    NVlabs/Fast-dLLM f6b35ec) commits, for R blocks: the ranks before the first rank n
    (1-based) whose confidence is below 1 - factor / (n + 1) (the first rank always
    passes), except that a failure at the last rank, or none, commits all. ranked [R, B]
    confidences in descending order (masked positions first), num_masked [R], factor [R]
    float; returns [R] int64."""
    block = ranked.shape[1]
    index = torch.arange(block)
    bar = 1.0 - factor.double()[:, None] / (index[None, :] + 2)  # [R, B]
    fails = ((ranked.double() < bar) & (index[None, :] >= 1)
             & (index[None, :] < num_masked[:, None]))  # [R, B]
    first = torch.where(fails, index[None, :], block).min(dim=1).values  # [R]
    return torch.where(first >= num_masked - 1, num_masked, first)


def active_sub_block(masked: torch.Tensor, sub_block_size: torch.Tensor) -> torch.Tensor:
    """[R, B] bool: the masked positions in each block's leftmost sub-block holding one
    (``masked`` [R, B] bool; ``sub_block_size`` [R] int64, the block size where a block
    has no sub-blocks). A block with no masked position keeps none."""
    block = masked.shape[1]
    positions = torch.arange(block)
    first = torch.where(masked, positions, block).min(dim=1).values  # [R]
    sub_block = positions[None, :] // sub_block_size[:, None]  # [R, B]
    return masked & (sub_block == (first // sub_block_size)[:, None])


def batched_choose_commits(confidence: torch.Tensor, masked: torch.Tensor,
                           steps_taken: torch.Tensor, steps_allowed: torch.Tensor,
                           strategy: torch.Tensor, threshold: torch.Tensor,
                           entropy: torch.Tensor | None = None,
                           entropy_bound: torch.Tensor | None = None,
                           eps: torch.Tensor | None = None,
                           alg: torch.Tensor | None = None,
                           entropy_bounded_by_confidence: torch.Tensor | None = None,
                           factor: torch.Tensor | None = None) -> torch.Tensor:
    """``choose_commits`` for R blocks at once (the engine's path; tested against it).

    confidence, masked: [R, B]; steps_taken (the block's step), steps_allowed (its
    ``steps_for``), strategy (index into ``STRATEGIES``): [R] int64; threshold: [R] float;
    entropy: [R, B] and entropy_bound: [R] float (needed where a block uses
    ``entropy_bounded``, with entropy_bounded_by_confidence: [R] bool, the blocks whose
    ``entropy_bounded_order`` is ``confidence``); eps: [R] float64 and alg: [R] int64 (an
    index into ``SCHEDULE_RANKINGS``) where a block uses ``timestep_schedule`` (with
    entropy where its alg is ``entropy``); factor: [R] float where a block uses
    ``factor``.
    """
    num_rows, block = masked.shape
    num_masked = masked.sum(dim=1)  # [R]

    # each rule below is computed where a block follows it; the shared parts once, lazily
    @functools.cache
    def last_step() -> torch.Tensor:  # [R, 1] bool: the block's last allowed step
        return (steps_taken >= steps_allowed - 1)[:, None]

    @functools.cache
    def conf() -> torch.Tensor:  # [R, B]: the masked positions' confidence, -inf elsewhere
        return torch.where(masked, confidence, torch.full_like(confidence, float("-inf")))

    @functools.cache
    def ranked() -> tuple[torch.Tensor, torch.Tensor]:
        """(order, rank) [R, B] of the masked positions by confidence, best first (ties
        to the lower position)."""
        order = torch.sort(conf(), dim=1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(
            1, order, torch.arange(block).expand(num_rows, block).contiguous())
        return order, rank

    @functools.cache
    def quota() -> torch.Tensor:  # [R, 1]: SDAR's quota of this step
        base, extra = block // steps_allowed, block % steps_allowed
        count = torch.where(steps_taken >= steps_allowed, torch.full_like(base, block),
                            base + (steps_taken < extra).long())
        return torch.minimum(count, num_masked)[:, None]

    def top() -> torch.Tensor:
        return (ranked()[1] < quota()) & masked

    def dynamic() -> torch.Tensor:
        above = masked & (confidence > threshold[:, None])
        enough = above.sum(dim=1, keepdim=True) >= quota()  # [R, 1]
        return above if bool(enough.all()) else torch.where(enough, above, top())

    def sequential() -> torch.Tensor:
        return masked & (masked.cumsum(dim=1) <= quota())

    def by_threshold() -> torch.Tensor:
        # the most confident masked position (argmax keeps the first of ties, as the
        # stable ranking does) and every one at or above the threshold
        best = torch.zeros_like(masked).scatter_(1, conf().argmax(dim=1, keepdim=True), True)
        chosen = masked & ((confidence >= threshold[:, None]) | best)
        return torch.where(last_step(), masked, chosen)

    def entropy_bounded() -> torch.Tensor:
        if entropy is None or entropy_bound is None or entropy_bounded_by_confidence is None:
            raise ValueError("the entropy_bounded strategy needs each proposal's entropy, "
                             "and each block's entropy_bound and order")
        return torch.where(last_step(), masked, entropy_bounded_commits(
            confidence, masked, entropy, entropy_bound, entropy_bounded_by_confidence))

    def timestep() -> torch.Tensor:
        if eps is None or alg is None:
            raise ValueError("the timestep_schedule strategy needs each block's eps and "
                             "alg")
        scheduled = strategy == STRATEGIES.index("timestep_schedule")  # [R]
        count = batched_timestep_quota(num_masked, steps_taken, steps_allowed, eps,
                                       scheduled)[:, None]  # [R, 1]
        score = schedule_score(confidence, entropy, torch.where(scheduled, alg, 0))
        score = torch.where(masked, score, torch.full_like(score, float("-inf")))
        by_score = torch.sort(score, dim=1, descending=True, stable=True).indices
        score_rank = torch.empty_like(by_score).scatter_(
            1, by_score, torch.arange(block).expand(num_rows, block).contiguous())
        return (score_rank < count) & masked

    def by_factor() -> torch.Tensor:
        if factor is None:
            raise ValueError("the factor strategy needs each block's factor")
        order, rank = ranked()
        count = batched_factor_count(conf().gather(1, order), num_masked, factor)[:, None]
        return torch.where(last_step(), masked, (rank < count) & masked)

    rules = (dynamic, top, sequential, by_threshold, entropy_bounded, timestep,
             by_factor)  # STRATEGIES order
    present = sorted(set(strategy.tolist()))
    if len(present) == 1:  # the common step: one strategy for every block
        return rules[present[0]]()
    chosen = torch.zeros_like(masked)
    for code in present:
        chosen = torch.where((strategy == code)[:, None], rules[code](), chosen)
    return chosen

