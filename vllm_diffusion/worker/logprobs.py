"""Logprobs of the tokens a denoising step proposes, for the requests that ask for them:
read from the distribution of the step that committed each token, as ``--logprobs-mode``
defines it. A step's rows travel as one float64 matrix [rows, 2 + 2k] (``columns``: value,
rank, top-k ids, top-k values). See docs/architecture.md, "Logprobs".
"""

from __future__ import annotations

import torch

from vllm_diffusion.worker.sampling import _GREEDY_EPS, batched_filter_top_k_top_p, filter_min_p

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


def wants_logprobs(params) -> bool:
    """Whether a request asks for logprobs: ``logprobs`` (top-k) or ``logprob_token_ids``
    (the generative-scoring endpoint's given tokens, which replace the top-k)."""
    return (getattr(params, "logprobs", None) is not None
            or bool(getattr(params, "logprob_token_ids", None)))


def asked_count(params) -> int:
    """The alternatives a request asks for per token (-1: the whole vocabulary)."""
    if params.logprobs is not None and not params.logprob_token_ids:
        return params.logprobs
    return len(params.logprob_token_ids)


WHOLE_VOCABULARY = 2**62  # a request's logprobs=-1 (``columns`` clips k to the vocabulary)


def top_count(params_list: list) -> int | None:
    """The most top logprobs any of the requests asks for (None: none asks)."""
    asked = [asked_count(p) for p in params_list if wants_logprobs(p)]
    if not asked:
        return None
    return max(WHOLE_VOCABULARY if k == -1 else k for k in asked)


def columns(logits: torch.Tensor, tokens: torch.Tensor, k: int, as_logits: bool
            ) -> torch.Tensor:
    """logits: [m, V] float32 (the distribution the mode names), tokens: [m] int64 the
    chosen tokens. Returns [m, 2 + 2k] float64: value, rank, k ids, k values."""
    k = min(k, logits.shape[-1])
    values = distribution_values(logits, as_logits)
    chosen = values.gather(1, tokens[:, None])  # [m, 1]
    rank = (values >= chosen).sum(dim=1, keepdim=True)
    top_values, top_ids = values.topk(k, dim=-1) if k else (values[:, :0], tokens[:, None][:, :0])
    return torch.cat([chosen.double(), rank.double(), top_ids.double(), top_values.double()],
                     dim=1)


def distribution_values(logits: torch.Tensor, as_logits: bool) -> torch.Tensor:
    return logits if as_logits else torch.log_softmax(logits, dim=-1)


def use_given_tokens(table: torch.Tensor, values: torch.Tensor, counts: list[int],
                     params: list) -> None:
    """In ``table`` ([m, 2 + 2k], the rows of the requests asking for logprobs, in order),
    replace the top-k of each request with ``logprob_token_ids`` by its given tokens'
    values (read from ``values`` [m, V], in the same distribution); k >= their count."""
    k = (table.shape[1] - 2) // 2
    row = 0
    for count, p in zip(counts, params):
        if not wants_logprobs(p):
            continue
        given = getattr(p, "logprob_token_ids", None)
        if given and count:
            ids = torch.tensor(given, dtype=torch.long, device=values.device)
            part = slice(row, row + count)
            table[part, 2:2 + k] = 0.0
            table[part, 2 + k:] = float("-inf")
            table[part, 2:2 + len(given)] = ids.double()
            table[part, 2 + k:2 + k + len(given)] = values[part][:, ids].double()
        row += count


def own_columns(rows: torch.Tensor, asked: int) -> torch.Tensor:
    """rows: [..., 2 + 2k] columns made with the step's largest k; the columns of a request
    that asked for ``asked`` top logprobs (-1: all of them): [..., 2 + 2 min(asked, k)]."""
    k = (rows.shape[-1] - 2) // 2
    own = k if asked == -1 else min(asked, k)  # asked: ``asked_count``
    return torch.cat([rows[..., :2 + own], rows[..., 2 + k:2 + k + own]], dim=-1)


def processed_logits(logits: torch.Tensor, params_by_row: list) -> torch.Tensor:
    """The logits each row's token was drawn from: ``logits`` ([m, V], after the logit
    stages) for greedy rows; for sampled rows scaled and filtered exactly as
    ``sampling.draw_for_requests`` does, filtered-out tokens at -inf."""
    sampled = [i for i, p in enumerate(params_by_row) if p.temperature >= _GREEDY_EPS]
    if not sampled:
        return logits
    out = logits.clone()
    device = logits.device
    rows = torch.tensor(sampled, device=device)
    chosen = [params_by_row[i] for i in sampled]
    scaled = logits[rows] / torch.tensor([p.temperature for p in chosen], device=device)[:, None]
    min_p = [getattr(p, "min_p", 0.0) or 0.0 for p in chosen]
    if any(m > 0 for m in min_p):
        scaled = filter_min_p(scaled, torch.tensor(min_p, dtype=scaled.dtype, device=device))
    top_p = [p.top_p for p in chosen]
    out[rows] = batched_filter_top_k_top_p(
        scaled, torch.tensor([p.top_k for p in chosen], device=device),
        torch.tensor(top_p, dtype=torch.float32, device=device),
        any_nucleus=any(p < 1.0 for p in top_p))
    return out


def to_vllm_lists(rows: list[torch.Tensor | None], tokens: list[list[int]]):
    """vLLM's ``LogprobsLists`` for a step's outputs (None when no request has rows):
    ``rows[i]`` the [len(tokens[i]), 2 + 2k] columns of request i's tokens ``tokens[i]``
    (None: not asked). Narrower requests are padded with token 0 at -inf (vLLM reads only
    each request's own k + 1 columns)."""
    import numpy as np
    from vllm.v1.outputs import LogprobsLists

    width = 1 + max(((r.shape[1] - 2) // 2 for r in rows if r is not None), default=0)
    starts, ids, values, ranks = [], [], [], []
    offset = 0
    for row, returned in zip(rows, tokens):
        starts.append(offset)
        count = len(returned)
        if row is None or not count:
            continue
        k = (row.shape[1] - 2) // 2
        token_ids = torch.zeros(count, width, dtype=torch.long)
        token_values = torch.full((count, width), float("-inf"), dtype=torch.float32)
        token_ids[:, 0] = torch.tensor(returned, dtype=torch.long)
        token_values[:, 0] = row[:, 0].float()
        token_ids[:, 1:k + 1] = row[:, 2:2 + k].long()
        token_values[:, 1:k + 1] = row[:, 2 + k:].float()
        ids.append(token_ids)
        values.append(token_values)
        ranks.append(row[:, 1].long())
        offset += count
    if not ids:
        return None
    return LogprobsLists(np.asarray(torch.cat(ids).numpy()),
                         np.asarray(torch.cat(values).numpy()),
                         np.asarray(torch.cat(ranks).numpy()), starts)
