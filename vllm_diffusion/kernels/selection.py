"""FOCUS token selection, torch references: the token budget (``token_budget``, Eq. 4) and
the retained set of a block (``select_retained``, with its two ``CONTEXT_RULES``), one
request at a time and batched; the rules: docs/kernels.md, "The ops".
"""

from __future__ import annotations

import math

import torch

CONTEXT_RULES = ("retained_left", "selected_left")


def wanted_by_rate(wanted: float, block_size: int) -> int:
    """ceil(alpha * mean_decoded), the whole block where it is not finite or larger."""
    return math.ceil(wanted) if math.isfinite(wanted) and wanted < block_size else block_size


def token_budget(delta: torch.Tensor, mean_decoded: float, alpha: float,
                 block_size: int) -> int:
    """delta: [n] importance deltas of the candidates (n >= 1). Always in [1, block_size],
    whatever the floats (a NaN delta counts for nothing, a non-finite product keeps the
    whole block)."""
    threshold = delta.mean() + delta.std(unbiased=False)
    n_sigma = int((delta >= threshold).sum())
    by_rate = wanted_by_rate(alpha * mean_decoded, block_size)
    return max(1, min(block_size, max(by_rate, n_sigma)))


def batched_token_budget(delta: torch.Tensor, candidates: torch.Tensor,
                         by_rate: torch.Tensor, block_size: int) -> torch.Tensor:
    """``token_budget`` of R blocks at once, where it evicts: [R] int64, the budget K of a
    block with candidates whose K is below their number, the block size otherwise (keeps
    every candidate). delta, candidates: [R, B]; by_rate: [R] (``wanted_by_rate``)."""
    count = candidates.sum(dim=1)
    values = torch.where(candidates, delta.float(), torch.zeros_like(delta, dtype=torch.float32))
    mean = values.sum(dim=1) / count.clamp(min=1)
    spread = torch.where(candidates, values - mean[:, None], torch.zeros_like(values))
    threshold = mean + (spread.square().sum(dim=1) / count.clamp(min=1)).sqrt()
    n_sigma = ((values >= threshold[:, None]) & candidates).sum(dim=1)
    budget = torch.maximum(by_rate.long(), n_sigma).clamp(1, block_size)
    return torch.where((count > 0) & (budget < count), budget,
                       torch.full_like(budget, block_size))


def select_retained(delta: torch.Tensor, candidates: torch.Tensor, budget: int,
                    processing: torch.Tensor, ever_processed: torch.Tensor,
                    context_rule: str = "retained_left") -> torch.Tensor:
    """The retained set S of one block.

    delta:          [B] float, importance delta (only read at candidates)
    candidates:     [B] bool, masked positions processed this step
    budget:         K, number of top candidates to keep
    processing:     [B] bool, positions processed this step (candidates and decoded
                    positions that need recomputation)
    ever_processed: [B] bool, positions processed at an earlier step of this block
    context_rule:   one of ``CONTEXT_RULES``
    Returns [B] bool; a subset of ``processing``.
    """
    retained = processing & ~candidates  # decoded positions needing recomputation
    if not bool(candidates.any()):
        return retained if bool(retained.any()) else processing.clone()
    scores = torch.where(candidates, delta.float(), torch.full_like(delta.float(), float("-inf")))
    order = torch.sort(scores, descending=True, stable=True).indices
    top = torch.zeros_like(candidates)
    top[order[:min(budget, int(candidates.sum()))]] = True
    retained |= top
    # AR-context preservation.
    if context_rule == "retained_left":
        left_of_retained = torch.zeros_like(retained)
        left_of_retained[:-1] = retained[1:]
        retained |= left_of_retained & processing
    elif context_rule == "selected_left":
        left_of_selected = torch.zeros_like(top)
        left_of_selected[:-1] = top[1:]
        retained |= left_of_selected & candidates
    else:
        raise ValueError(f"unknown context rule {context_rule!r}; one of {CONTEXT_RULES}")
    # Placeholder integrity: masked positions never processed in this block, left of the
    # rightmost retained position, have no KV yet; compute them now.
    rightmost = int(torch.nonzero(retained).max()) if bool(retained.any()) else -1
    left_of_rightmost = torch.arange(len(retained), device=retained.device) < rightmost
    retained |= candidates & ~ever_processed & left_of_rightmost
    if not bool(retained.any()):
        return processing.clone()
    return retained


def batched_select_retained(delta: torch.Tensor, candidates: torch.Tensor,
                            budgets: torch.Tensor, processing: torch.Tensor,
                            ever_processed: torch.Tensor,
                            selected_left: torch.Tensor) -> torch.Tensor:
    """``select_retained`` for R requests at once; all arguments [R, B] except budgets and
    selected_left ([R]; True: the ``selected_left`` context rule for that request)."""
    return torch.stack([
        select_retained(d, c, int(k), p, e, "selected_left" if bool(s) else "retained_left")
        for d, c, k, p, e, s in zip(delta, candidates, budgets, processing, ever_processed,
                                    selected_left)])


def vectorised_select_retained(delta: torch.Tensor, candidates: torch.Tensor,
                               budgets: torch.Tensor, processing: torch.Tensor,
                               ever_processed: torch.Tensor,
                               selected_left: torch.Tensor) -> torch.Tensor:
    """``batched_select_retained`` as tensor operations over all R requests at once (the
    torch path: no per-request loop)."""
    requests, size = candidates.shape
    device = candidates.device
    recompute = processing & ~candidates  # decoded positions needing recomputation
    scores = torch.where(candidates, delta.float(), torch.full_like(delta, float("-inf"),
                                                                    dtype=torch.float32))
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    positions = torch.arange(size, device=device)
    rank = torch.empty_like(order).scatter_(1, order, positions.expand(requests, size)
                                            .contiguous())
    wanted = torch.minimum(budgets.to(device).long(), candidates.sum(dim=1))
    top = rank < wanted[:, None]  # the first K of the order, as the reference takes them
    retained = recompute | top
    left_of_retained = torch.zeros_like(retained)
    left_of_retained[:, :-1] = retained[:, 1:]
    left_of_top = torch.zeros_like(top)
    left_of_top[:, :-1] = top[:, 1:]
    retained = torch.where(selected_left.to(device).bool()[:, None],
                           retained | (left_of_top & candidates),
                           retained | (left_of_retained & processing))
    rightmost = torch.where(retained, positions, torch.full_like(positions, -1)).max(dim=1)
    retained |= candidates & ~ever_processed & (positions[None, :] < rightmost.values[:, None])
    retained = torch.where(retained.any(dim=1, keepdim=True), retained, processing)
    # without candidates: the recomputed positions, or the whole processing set
    plain = torch.where(recompute.any(dim=1, keepdim=True), recompute, processing)
    return torch.where(candidates.any(dim=1, keepdim=True), retained, plain)
