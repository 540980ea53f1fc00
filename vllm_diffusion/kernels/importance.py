"""Token importance inside a diffusion block (FOCUS, Eq. 2-3): plain PyTorch reference and
the batched torch path. For one block's candidates (its masked positions, in order),
I[b] = sum_h sum_a softmax_b(maxpool_b(q_a . k_b * scale))[b], the max-pool over adjacent
candidates; docs/kernels.md, "The ops".
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
    sizes = [rows[i].numel() for i in present]
    width, device = max(sizes), query.device
    valid = (torch.arange(width, device=device)[None, :]
             < torch.tensor(sizes, device=device)[:, None])  # [P, n]
    index = torch.zeros(len(present), width, dtype=torch.long, device=device)
    index[valid] = torch.cat([rows[i] for i in present]).to(device)
    heads, kv_heads = query.shape[1], key.shape[1]
    # GQA without repeating keys: query head h = kv head h // group
    q = query[index].float().view(len(present), width, kv_heads, heads // kv_heads, -1)
    scores = torch.einsum("pahgd,pbhd->phgab", q, key[index].float()).reshape(
        len(present), heads, width, width) * scale  # [P, H, n, n]
    invalid = ~valid[:, None, None, :]
    scores = scores.masked_fill(invalid, float("-inf"))
    kernels = [pool_kernels[i] for i in present]
    for kernel in sorted(set(kernels)):
        if kernel <= 1:
            continue
        pooled = F.max_pool1d(scores.reshape(-1, 1, width), kernel, stride=1,
                              padding=kernel // 2).reshape(scores.shape)
        if len(set(kernels)) == 1:
            scores = pooled
        else:
            chosen = torch.tensor([k == kernel for k in kernels], device=device)
            scores = torch.where(chosen[:, None, None, None], pooled, scores)
    # Pooling spreads scores into padded columns: mask them again before the softmax.
    scores = scores.masked_fill(invalid, float("-inf"))
    weights = scores.softmax(dim=-1) * valid[:, None, :, None]  # padded queries count 0
    importance = weights.sum(dim=(1, 2))[valid].split(sizes)  # [n_r] per request
    out: list[torch.Tensor | None] = [None] * len(rows)
    for j, i in enumerate(present):
        out[i] = importance[j]
    return out


def looped_candidate_importance(query: torch.Tensor, key: torch.Tensor,
                                rows: list[torch.Tensor | None], scale: float,
                                pool_kernels: list[int]) -> list[torch.Tensor | None]:
    """``candidate_importance`` request by request, with ``batched_candidate_importance``'s
    signature (the reference the batched paths are compared with)."""
    return [None if r is None or r.numel() == 0 else
            candidate_importance(query[r], key[r], scale, kernel)
            for r, kernel in zip(rows, pool_kernels)]
