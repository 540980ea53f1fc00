"""Plain per-block references of the engine's batched commit choice
(``vllm_diffusion.policies.rules.choose_commits``: one module per rule) and of its quotas:
which positions of one block each unmasking strategy commits at a step. Written with
plain loops and torch, importing no package code (a config is read by its attribute
names: ``strategy``, ``threshold``, ``denoising_steps``, ``entropy_bound``,
``entropy_bounded_order``, ``factor``, ``alg``, ``eps``).
"""

from __future__ import annotations

import functools

import torch


def step_quota(block_size: int, steps: int, step: int) -> int:
    """Positions to commit at denoising step ``step`` of a block (SDAR's schedule)."""
    if step >= steps:
        return block_size
    return block_size // steps + (1 if step < block_size % steps else 0)


@functools.lru_cache(maxsize=64)
def timesteps(steps: int, eps: float) -> torch.Tensor:
    """[steps + 1] float32: ``linspace(1, eps, steps + 1)`` as Dream's loop makes them."""
    return torch.linspace(1, eps, steps + 1)


def timestep_quota(num_masked: int, step: int, steps: int, eps: float) -> int:
    """Masked positions to unmask at block step ``step`` of ``steps`` (``batched_timestep_quota``)."""
    if step >= steps - 1:
        return num_masked
    times = timesteps(steps, eps)
    masks = torch.tensor(num_masked) / 1  # float32, as the published ``sum() / batch``
    return int(masks * (1 - times[step + 1] / times[step]))


def top_by_confidence(confidence: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest confidences; ties go to the lower position."""
    order = torch.sort(confidence, descending=True, stable=True).indices
    return order[:k]


def choose_commits(confidence: torch.Tensor, masked: torch.Tensor, step: int,
                   block_size: int, config,
                   entropy: torch.Tensor | None = None) -> torch.Tensor:
    """Which positions of one block to commit this step (the plain reference of
    ``rules.choose_commits``).

    confidence: [B] float, the probability of each position's proposed token.
    masked:     [B] bool, positions still holding the mask token.
    entropy:    [B] float, each position's proposal entropy (``entropy_bounded`` and
                ``timestep_schedule`` with ``alg`` ``entropy`` only).
    Returns a [B] bool tensor; only masked positions are ever chosen, at least one if any
    position is masked (``timestep_schedule``: none at a step its schedule leaves empty).
    """
    num_masked = int(masked.sum())
    commit = torch.zeros_like(masked)
    if num_masked == 0:
        return commit
    steps = config.denoising_steps or block_size
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
        if config.entropy_bounded_order == "entropy":
            low_first = torch.where(masked, entropy, torch.full_like(entropy, float("inf")))
            order = torch.sort(low_first, stable=True).indices[:num_masked].tolist()
        else:
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
    elif strategy == "factor":
        if step >= steps - 1:
            return masked.clone()
        order = top_by_confidence(conf, num_masked)  # the masked positions, best first
        commit[order[:factor_count(confidence[order], config.factor)]] = True
    elif strategy == "timestep_schedule":
        count = timestep_quota(num_masked, step, steps, config.eps)
        score = confidence if config.alg == "maskgit_plus" else -entropy
        score = torch.where(masked, score, torch.full_like(score, float("-inf")))
        commit[top_by_confidence(score, count)] = True
    else:  # parse_options restricts strategy to STRATEGIES
        raise AssertionError(strategy)
    return commit


def factor_count(ranked: torch.Tensor, factor: float) -> int:
    """How many masked positions Fast-dLLM's dynamic rule (``get_transfer_index_dynamic``,
    NVlabs/Fast-dLLM f6b35ec) commits, from their confidences in descending order
    (``ranked``: [m], m >= 1): the ranks before the first rank n (1-based) whose
    confidence is below 1 - factor / (n + 1) (the first rank always passes), except that
    a failure at the last rank, or none, commits all m."""
    m = len(ranked)
    for index in range(1, m):
        if float(ranked[index]) < 1.0 - factor / (index + 2):
            return m if index == m - 1 else index
    return m
