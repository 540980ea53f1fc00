"""Proposing a token and its confidence for every position of a block: the last stages of
the proposal pipeline (``draw_for_requests``: greedy arg-max, or temperature, min-p,
top-k / top-p and a draw with the request's generator). The plain per-request reference
is ``tests/reference_sampling.py``.
"""

from __future__ import annotations

import copy
import itertools

import torch

_GREEDY_EPS = 1e-5  # vLLM treats temperatures below this as greedy
# A proposal row's validity (``proposal.invalid_rows``): valid, no token left after the
# logit stages, a logit NaN / overflowed, or its request's proposals raised.
ROW_VALID, ROW_NO_TOKEN, ROW_NOT_FINITE, ROW_FAILED = 0, 1, 2, 3


def argmax_params(params):
    """A copy of ``params`` proposing the argmax (temperature 0), its other fields kept."""
    greedy = copy.copy(params)
    greedy.temperature = 0.0
    return greedy


def filter_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [n, V] (after temperature, before top-k / top-p as vLLM), min_p [n]: tokens
    below min_p times the row's largest probability go to -inf."""
    probs = logits.softmax(dim=-1)
    floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < floor, float("-inf"))


def batched_filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor,
                               top_p: torch.Tensor, any_nucleus: bool | None = None
                               ) -> torch.Tensor:
    """Top-k then top-p filtering with a top_k and top_p per row ([n] each): entries
    filtered out go to -inf; a token is dropped once the tokens ranked above it reach
    top_p, the most likely one always stays. ``any_nucleus``: whether some row has
    top_p < 1, when the caller knows it on the host."""
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    logits = logits.masked_fill(logits < kth, float("-inf"))
    nucleus = top_p < 1.0
    if any_nucleus is None:
        any_nucleus = bool(nucleus.any())  # a device-to-host read; callers pass it
    if any_nucleus:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
        drop_sorted[:, 0] = False  # the most likely token always stays
        drop_sorted &= nucleus[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def draw_for_requests(logits: torch.Tensor, counts: list[int], params: list,
                      generators: list, max_probability: bool = False,
                      with_entropy: bool = False, invalid: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, ...]:
    """Temperature, top-k / top-p and the draw for the rows of several requests at once.
    logits: [n, V] float32, request i owns the next ``counts[i]`` rows. Sampled rows are
    filtered together and drawn per request with ``generators[i]``, in request order (a
    seeded request draws as when alone); confidence: the drawn token's probability, or the
    filtered distribution's largest with ``max_probability``. With ``with_entropy`` a
    third tensor [n]: each row's entropy (nats). ``invalid`` ([n] int8): a sampled row
    whose scaled logits are not finite is drawn from a uniform stand-in instead of
    reaching ``torch.multinomial``, and flagged ``ROW_NOT_FINITE`` in place where valid."""
    probs = logits.softmax(dim=-1)
    confidence, tokens = probs.max(dim=-1)
    entropy = torch.special.entr(probs).sum(dim=-1) if with_entropy else None
    del probs
    sampled = [i for i, p in enumerate(params) if p.temperature >= _GREEDY_EPS]
    if not sampled:
        return (tokens, confidence, entropy) if with_entropy else (tokens, confidence)
    starts = [0, *itertools.accumulate(counts)]
    spans = [range(starts[i], starts[i + 1]) for i in sampled]
    rows = torch.tensor([row for span in spans for row in span], dtype=torch.long)
    per_row = [(params[i].temperature, params[i].top_k, params[i].top_p,
                getattr(params[i], "min_p", 0.0) or 0.0)
               for i, span in zip(sampled, spans) for _ in span]
    temperature, top_k, top_p, min_p = zip(*per_row)
    rows_device = rows.to(logits.device)
    scaled = logits[rows_device] / torch.tensor(temperature, device=logits.device)[:, None]
    finite = torch.isfinite(scaled.amax(dim=-1))  # [m]; no host read: one per step
    scaled = scaled.masked_fill(~finite[:, None], 0.0)
    if invalid is not None:
        flagged = invalid[rows_device]
        invalid[rows_device] = flagged.masked_fill(~finite & (flagged == ROW_VALID),
                                                   ROW_NOT_FINITE)
    if any(p > 0 for p in min_p):
        scaled = filter_min_p(scaled, torch.tensor(min_p, dtype=scaled.dtype,
                                                   device=logits.device))
    probs = batched_filter_top_k_top_p(
        scaled, torch.tensor(top_k, device=logits.device),
        torch.tensor(top_p, dtype=torch.float32, device=logits.device),
        any_nucleus=any(p < 1.0 for p in top_p)).softmax(dim=-1)
    offset = 0
    for i, span in zip(sampled, spans):
        part = probs[offset:offset + len(span)]
        drawn = torch.multinomial(part, 1, generator=generators[i])  # [n_i, 1]
        tokens[rows_device[offset:offset + len(span)]] = drawn.squeeze(1)
        chosen = part.max(dim=1).values if max_probability else part.gather(1, drawn).squeeze(1)
        confidence[rows_device[offset:offset + len(span)]] = chosen
        if with_entropy:
            entropy[rows_device[offset:offset + len(span)]] = torch.special.entr(part).sum(dim=1)
        offset += len(span)
    return (tokens, confidence, entropy) if with_entropy else (tokens, confidence)
