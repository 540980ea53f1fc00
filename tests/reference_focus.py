"""A plain-PyTorch reference of FOCUS decoding (greedy, exact commit), no paging, no batching.

Per block and step: the processed positions (all at the block's first step, then the
positions the neighbour-aware cache has not frozen) run through the layers one by one.
Every layer stores their keys/values in a per-layer block store; queries attend to the
committed prefix (exact: a clean block-causal forward) and the block store. At layer 1,
after the store, the importance delta selects the retained positions; they alone
continue, and from layer 1's attention on the block keys stop after the rightmost
retained position. Unmasking sees only retained positions.

Everything FOCUS-specific is written here again from the paper (Eq. 2-4, Section 4.3) with
plain loops, independently of the package: importance, budget, retained set, the
neighbour-aware cache. Unmasking uses the SDAR reference's strategies.
"""

from __future__ import annotations

import math

import torch
from reference_sdar import ReferenceSDAR, block_causal_mask, rms_norm, select_positions, transfer_quotas


def importance(q: torch.Tensor, k: torch.Tensor, scale: float, kernel: int) -> torch.Tensor:
    """Incoming attention of each candidate (FOCUS Eq. 2-3). q: [n, H, D], k: [n, Hkv, D]."""
    n, heads = q.shape[0], q.shape[1]
    group = heads // k.shape[1]
    total = torch.zeros(n)
    for h in range(heads):
        scores = (q[:, h].float() @ k[:, h // group].float().T) * scale  # [n, n]
        pooled = torch.empty_like(scores)
        for b in range(n):  # MaxPool1D over keys, window clipped at the ends
            lo, hi = max(0, b - kernel // 2), min(n, b + kernel // 2 + 1)
            pooled[:, b] = scores[:, lo:hi].max(dim=1).values
        total += pooled.softmax(dim=1).sum(dim=0)
    return total


def budget_k(delta: list[float], mean_decoded: float, alpha: float, block_size: int) -> int:
    """K = min(B, max(ceil(alpha * mean decoded per step), N_sigma)) (Eq. 4)."""
    mean = sum(delta) / len(delta)
    std = math.sqrt(sum((d - mean) ** 2 for d in delta) / len(delta))
    n_sigma = sum(1 for d in delta if d >= mean + std)
    return min(block_size, max(math.ceil(alpha * mean_decoded), n_sigma))


def retained_set(delta: list[float], masked: list[bool], k: int, processing: list[bool],
                 ever_processed: list[bool]) -> list[bool]:
    """Top-k masked candidates by delta (ties to the left), each retained position's left
    neighbour, never-processed masks left of the rightmost retained position, and the
    decoded positions being recomputed."""
    size = len(delta)
    candidates = [i for i in range(size) if masked[i] and processing[i]]
    keep = [processing[i] and not masked[i] for i in range(size)]
    if not candidates:
        return keep if any(keep) else list(processing)
    for i in sorted(candidates, key=lambda i: (-delta[i], i))[:k]:
        keep[i] = True
    for i in range(size - 1):
        if keep[i + 1] and processing[i]:
            keep[i] = True
    rightmost = max(i for i in range(size) if keep[i])
    for i in candidates:
        if i < rightmost and not ever_processed[i]:
            keep[i] = True
    return keep


class NeighbourCache:
    """Section 4.3: a decoded position stops being computed once it and its right
    neighbour were both decoded before a step (all positions on the block's first step)."""

    def __init__(self, size: int) -> None:
        self.frozen, self.started = [False] * size, False

    def processing(self) -> list[bool]:
        if not self.started or all(self.frozen):
            return [True] * len(self.frozen)
        return [not f for f in self.frozen]

    def after_step(self, masked_before: list[bool]) -> None:
        size = len(masked_before)
        for i in range(size):
            right_decoded = i == size - 1 or not masked_before[i + 1]
            if not masked_before[i] and right_decoded:
                self.frozen[i] = True
        self.started = True


def project(model: ReferenceSDAR, x: torch.Tensor, positions: torch.Tensor, layer: int):
    """q [n, H, D], k [n, Hkv, D], v [n, Hkv, D] of rows ``x`` at ``positions``."""
    w, p = model.weights, f"model.layers.{layer}.self_attn"
    n = x.shape[0]
    h = rms_norm(x, w[f"model.layers.{layer}.input_layernorm.weight"], model.eps)
    q = (h @ w[f"{p}.q_proj.weight"].T).view(n, model.num_heads, model.head_dim)
    k = (h @ w[f"{p}.k_proj.weight"].T).view(n, model.num_kv_heads, model.head_dim)
    v = (h @ w[f"{p}.v_proj.weight"].T).view(n, model.num_kv_heads, model.head_dim)
    q = rms_norm(q, w[f"{p}.q_norm.weight"], model.eps)
    k = rms_norm(k, w[f"{p}.k_norm.weight"], model.eps)
    q = model._rope(q.transpose(0, 1), positions).transpose(0, 1)
    k = model._rope(k.transpose(0, 1), positions).transpose(0, 1)
    return q, k, v


def attend_and_mlp(model, x, q, keys, values, visible, layer):
    """Finish layer ``layer`` for rows ``x`` given their queries and visible keys/values."""
    w, p = model.weights, f"model.layers.{layer}"
    group = model.num_heads // model.num_kv_heads
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q.transpose(0, 1) @ k.transpose(1, 2)) / math.sqrt(model.head_dim)
    out = scores.masked_fill(~visible[None], float("-inf")).softmax(-1) @ v  # [H, n, D]
    out = out.transpose(0, 1).reshape(x.shape[0], -1) @ w[f"{p}.self_attn.o_proj.weight"].T
    x = x + out
    return x + model._mlp(rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], model.eps),
                          f"{p}.mlp")


def prefix_kv(model: ReferenceSDAR, tokens: list[int], block_size: int):
    """Exact keys/values of every layer for the committed tokens: lists of [L, Hkv, D]."""
    x = model.weights["model.embed_tokens.weight"][torch.tensor(tokens, dtype=torch.long)]
    positions = torch.arange(len(tokens))
    mask = block_causal_mask(len(tokens), block_size)
    keys, values = [], []
    for layer in range(model.num_layers):
        q, k, v = project(model, x, positions, layer)
        keys.append(k)
        values.append(v)
        x = attend_and_mlp(model, x, q, k, v, mask, layer)
    return keys, values


def block_stores(model: ReferenceSDAR, block_size: int):
    """Per-layer key and value stores of one block, [B, Hkv, D] each (zeros)."""
    keys = [torch.zeros(block_size, model.num_kv_heads, model.head_dim)
            for _ in range(model.num_layers)]
    return keys, [torch.zeros_like(k) for k in keys]


def proposals(logits: torch.Tensor, rows: torch.Tensor, size: int, mask_id: int):
    """Greedy proposals of block positions ``rows`` (mask token banned): [B] confidence
    (-inf where not computed) and [B] token (the mask where not computed)."""
    logits[:, mask_id] = float("-inf")
    probs = logits.float().softmax(-1)
    confidence = torch.full((size,), float("-inf"))
    proposal = torch.full((size,), mask_id)
    confidence[rows], proposal[rows] = probs.max(-1)
    return confidence, proposal


def generate_by_blocks(prompt: list[int], block_size: int, mask_id: int, max_tokens: int,
                       stop_token_ids, decode_block) -> list[int]:
    """Blocks on the absolute grid (the first holds the prompt's tail);
    ``decode_block(start, committed, block)`` returns the block fully decoded. Output stops
    after a stop token or at ``max_tokens``."""
    start = len(prompt) // block_size * block_size
    committed = list(prompt[:start])
    block = torch.tensor(prompt[start:] + [mask_id] * (block_size - len(prompt) % block_size))
    output = []
    while True:
        block = decode_block(start, committed, block)
        for position, token in enumerate(block.tolist(), start=start):
            if position < len(prompt):
                continue
            output.append(token)
            if token in stop_token_ids or len(output) == max_tokens:
                return output
        committed += block.tolist()
        start += block_size
        block = torch.full((block_size,), mask_id)


@torch.no_grad()
def reference_focus_generate(model: ReferenceSDAR, prompt: list[int], *, block_size: int,
                             mask_id: int, max_tokens: int, config,
                             stop_token_ids=frozenset()) -> list[int]:
    """``config``: a FocusConfig (strategy, threshold, alpha, pool_kernel, evict,
    intra_block_cache); greedy; exact commit."""
    w = model.weights
    steps_cap = config.denoising_steps or block_size
    quotas = transfer_quotas(block_size, steps_cap)
    decoded_steps, decoded_tokens = 0, 0  # over the request (the across-blocks mean)

    def decode_block(start, committed, block):
        nonlocal decoded_steps, decoded_tokens
        prefix_k, prefix_v = prefix_kv(model, committed, block_size) if committed else (None, None)
        store_k, store_v = block_stores(model, block_size)
        cache, ever_processed, step = NeighbourCache(block_size), [False] * block_size, 0
        while bool((block == mask_id).any()):
            masked = block == mask_id
            processing = (torch.tensor(cache.processing()) if config.intra_block_cache
                          else torch.ones(block_size, dtype=torch.bool))
            rows = torch.nonzero(processing).flatten()  # block positions computed, ascending
            x = w["model.embed_tokens.weight"][block[rows]]
            layer_importance, key_end = [], block_size
            for layer in range(model.num_layers):
                q, k, v = project(model, x, start + rows, layer)
                store_k[layer][rows], store_v[layer][rows] = k, v
                if layer < 2:
                    cand = masked[rows]
                    layer_importance.append(importance(q[cand], k[cand], model.head_dim ** -0.5,
                                                       config.pool_kernel))
                if layer == 1 and config.evict and bool(masked.any()):
                    delta = [0.0] * block_size
                    for i, d in zip(torch.nonzero(masked).flatten().tolist(),
                                    (layer_importance[1] - layer_importance[0]).tolist()):
                        delta[i] = d
                    mean = decoded_tokens / decoded_steps if decoded_steps else 1.0
                    k_budget = budget_k([delta[i] for i in range(block_size) if masked[i]], mean,
                                        config.alpha, block_size)
                    if k_budget < int(masked.sum()):
                        chosen = retained_set(delta, masked.tolist(), k_budget,
                                              processing.tolist(), ever_processed)
                        keep = torch.tensor(chosen)[rows]
                        rows, x, q = rows[keep], x[keep], q[keep]
                        if not bool(keep.all()):
                            key_end = int(rows.max()) + 1
                block_k, block_v = store_k[layer][:key_end], store_v[layer][:key_end]
                keys = torch.cat([prefix_k[layer], block_k]) if committed else block_k
                values = torch.cat([prefix_v[layer], block_v]) if committed else block_v
                visible = torch.ones(len(rows), keys.shape[0], dtype=torch.bool)
                x = attend_and_mlp(model, x, q, keys, values, visible, layer)
            logits = rms_norm(x, w["model.norm.weight"], model.eps) @ w["lm_head.weight"].T
            confidence, proposal = proposals(logits, rows, block_size, mask_id)
            eligible = torch.zeros(block_size, dtype=torch.bool)
            eligible[rows] = True
            quota = quotas[step] if step < steps_cap else block_size
            candidates = masked & eligible
            confidence = torch.where(candidates, confidence, torch.full_like(confidence, float("-inf")))
            commit = select_positions(config.strategy, confidence, candidates, quota,
                                      config.threshold, last_step=step >= steps_cap - 1)
            block = torch.where(commit, proposal, block)
            cache.after_step(masked.tolist())
            ever_processed = [e or bool(g) for e, g in zip(ever_processed, eligible)]
            decoded_steps, decoded_tokens, step = decoded_steps + 1, decoded_tokens + int(commit.sum()), step + 1
            assert step <= 64 * steps_cap
        return block

    return generate_by_blocks(prompt, block_size, mask_id, max_tokens, stop_token_ids,
                              decode_block)
