"""Token importance inside a diffusion block (FOCUS, Eq. 2-3): plain PyTorch reference.

For the candidate positions of one block (its masked positions, ordered by position),
from q and k after q/k-norm and RoPE:

    S[h, a, b]  = q_a . k_b * scale                     pre-softmax scores among candidates
    S~[h, a, b] = max(S[h, a, b-1], S[h, a, b], S[h, a, b+1])   MaxPool1D over keys (kernel 3)
    I[b]        = sum_h sum_a softmax_b(S~[h, a, :])[b]  total incoming attention

and FOCUS's importance delta is ``I(layer 1) - I(layer 0)`` (``policies/focus/hooks.py``). Neighbours in the pooling are
adjacent candidates (the compacted candidate list), as in the FOCUS implementation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

def candidate_importance(query: torch.Tensor, key: torch.Tensor, scale: float,
                         pool_kernel: int = 3) -> torch.Tensor:
    """query: [n, H, D], key: [n, H_kv, D] of the candidates; returns I: [n] float32."""
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    key = key.repeat_interleave(num_heads // num_kv_heads, dim=1)  # GQA: head h uses h // group
    scores = torch.einsum("ahd,bhd->hab", query.float(), key.float()) * scale  # [H, n, n]
    if pool_kernel > 1:
        heads, n, _ = scores.shape
        scores = F.max_pool1d(scores.reshape(heads * n, 1, n), pool_kernel, stride=1,
                              padding=pool_kernel // 2).reshape(heads, n, n)
    return scores.softmax(dim=-1).sum(dim=(0, 1))


def batched_candidate_importance(query: torch.Tensor, key: torch.Tensor,
                                 rows: list[torch.Tensor | None], scale: float,
                                 pool_kernels: list[int]) -> list[torch.Tensor | None]:
    """Importance of every request's candidates in one call (``candidate_importance`` per
    request, vectorised over requests).

    query: [T, H, D], key: [T, H_kv, D] of the whole step; rows[r]: query rows of request
    r's candidates (ascending positions) or None; returns I per request ([n_r] or None).
    """
    present = [i for i, r in enumerate(rows) if r is not None and r.numel() > 0]
    if not present:
        return [None] * len(rows)
    counts = torch.tensor([rows[i].numel() for i in present], device=query.device)
    width = int(counts.max())
    valid = torch.arange(width, device=query.device)[None, :] < counts[:, None]  # [P, n]
    index = torch.zeros(len(present), width, dtype=torch.long, device=query.device)
    for j, i in enumerate(present):
        index[j, :rows[i].numel()] = rows[i]
    group = query.shape[1] // key.shape[1]
    q = query[index].float()  # [P, n, H, D]
    k = key[index].float().repeat_interleave(group, dim=2)  # [P, n, H, D]
    scores = torch.einsum("pahd,pbhd->phab", q, k) * scale  # [P, H, n, n]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    kernels = torch.tensor([pool_kernels[i] for i in present])
    for kernel in kernels.unique().tolist():
        if kernel <= 1:
            continue
        chosen = torch.nonzero(kernels == kernel).flatten().to(query.device)
        part = scores[chosen]
        scores[chosen] = F.max_pool1d(part.reshape(-1, 1, width), kernel, stride=1,
                                      padding=kernel // 2).reshape(part.shape)
    # Pooling spreads scores into padded columns: mask them again before the softmax.
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    weights = scores.softmax(dim=-1) * valid[:, None, :, None]  # padded queries count 0
    importance = weights.sum(dim=(1, 2))  # [P, n]
    out: list[torch.Tensor | None] = [None] * len(rows)
    for j, i in enumerate(present):
        out[i] = importance[j, :rows[i].numel()]
    return out


def looped_candidate_importance(query: torch.Tensor, key: torch.Tensor,
                                rows: list[torch.Tensor | None], scale: float,
                                pool_kernels: list[int]) -> list[torch.Tensor | None]:
    """``candidate_importance`` request by request, with ``batched_candidate_importance``'s
    signature (the reference the batched paths are compared with)."""
    return [None if r is None or r.numel() == 0 else
            candidate_importance(query[r], key[r], scale, kernel)
            for r, kernel in zip(rows, pool_kernels)]
