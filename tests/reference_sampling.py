"""The plain per-request reference of the engine's token proposals (the proposal
pipeline, ``vllm_diffusion/worker/proposal.py``): greedy, the arg-max and its softmax
probability; sampled, temperature, then min-p, top-k and top-p filtering, a draw from the
filtered distribution with the request's generator, and as confidence the drawn token's
probability (or the distribution's largest, ``max_probability``). The mask token is never
proposed. Torch only, importing no package code.
"""

from __future__ import annotations

import torch

GREEDY_EPS = 1e-5  # vLLM treats temperatures below this as greedy


def filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Tokens below min_p times the row's largest probability go to -inf."""
    probs = logits.softmax(dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values,
                              float("-inf"))


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [n, V] float32; returns logits with filtered-out entries at -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token once the tokens ranked above it already reach top_p.
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p
        # The most likely token always stays: with a tiny top_p, rounding in the
        # cumulative sum would otherwise drop every token.
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def propose_tokens(logits: torch.Tensor, mask_token_id: int, temperature: float,
                   top_k: int, top_p: float, generator: torch.Generator | None,
                   max_probability: bool = False, min_p: float = 0.0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [n, V]. Returns proposed tokens [n] int64 and their confidences [n] float32
    (with ``max_probability``: the largest probability of each row's distribution)."""
    logits = logits.float()
    logits[:, mask_token_id] = float("-inf")
    if temperature < GREEDY_EPS:
        confidence, tokens = logits.softmax(dim=-1).max(dim=-1)
        return tokens, confidence
    scaled = logits / temperature
    if min_p > 0:
        scaled = filter_min_p(scaled, float(min_p))
    probs = filter_top_k_top_p(scaled, top_k, top_p).softmax(dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator)  # [n, 1]
    if max_probability:
        return tokens.squeeze(1), probs.max(dim=1).values
    return tokens.squeeze(1), probs.gather(1, tokens).squeeze(1)


