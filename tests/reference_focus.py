"""A plain-PyTorch reference of FOCUS decoding (greedy, exact commit), no paging, no batching.

Per block and step: the processed positions (all at the block's first step, then the
positions the neighbour-aware cache has not frozen) run through the layers one by one.
Every layer stores their keys/values in a per-layer block store; queries attend to the
committed prefix (exact: a clean block-causal forward) and the block store. At layer 1,
after the store, the importance delta selects the retained positions; they alone
continue, and from layer 1's attention on the block keys stop after the rightmost
retained position. Unmasking sees only retained positions. The budget, selection and cache rules
are the package's (tested on hand-built inputs in test_focus_selection.py).
"""

from __future__ import annotations

import math

import torch
from reference_sdar import ReferenceSDAR, block_causal_mask, rms_norm, transfer_quotas

from vllm_diffusion.attention.importance import candidate_importance
from vllm_diffusion.policies.focus_selection import IntraBlockCache, select_retained, token_budget
from vllm_diffusion.policies.standard import StandardPolicyConfig, choose_commits


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


@torch.no_grad()
def reference_focus_generate(model: ReferenceSDAR, prompt: list[int], *, block_size: int,
                             mask_id: int, max_tokens: int, config,
                             stop_token_ids=frozenset()) -> list[int]:
    """``config``: a FocusPolicyConfig (strategy, threshold, alpha, pool_kernel, evict,
    intra_block_cache); greedy; exact commit."""
    w = model.weights
    steps_cap = config.denoising_steps or block_size
    start = len(prompt) // block_size * block_size
    committed = list(prompt[:start])
    block = torch.tensor(prompt[start:] + [mask_id] * (block_size - len(prompt) % block_size))
    output, decoded_steps, decoded_tokens = [], 0, 0
    while True:
        prefix_k, prefix_v = prefix_kv(model, committed, block_size) if committed else (None, None)
        store_k = [torch.zeros(block_size, model.num_kv_heads, model.head_dim)
                   for _ in range(model.num_layers)]
        store_v = [torch.zeros_like(k) for k in store_k]
        cache, ever_processed, step = IntraBlockCache(block_size), torch.zeros(block_size, dtype=torch.bool), 0
        while bool((block == mask_id).any()):
            masked = block == mask_id
            processing = (cache.processing_set() if config.intra_block_cache
                          else torch.ones(block_size, dtype=torch.bool))
            rows = torch.nonzero(processing).flatten()  # block positions computed, ascending
            x = w["model.embed_tokens.weight"][block[rows]]
            importance, key_end = [], block_size
            for layer in range(model.num_layers):
                q, k, v = project(model, x, start + rows, layer)
                store_k[layer][rows], store_v[layer][rows] = k, v
                if layer < 2:
                    cand = masked[rows]
                    importance.append(candidate_importance(q[cand], k[cand], model.head_dim ** -0.5,
                                                           config.pool_kernel))
                if layer == 1 and config.evict and bool(masked.any()):
                    delta = torch.zeros(block_size)
                    delta[masked] = importance[1] - importance[0]
                    mean = decoded_tokens / decoded_steps if decoded_steps else 1.0
                    budget = token_budget(delta[masked], mean, config.alpha, block_size)
                    if budget < int(masked.sum()):
                        keep = select_retained(delta, masked, budget, processing, ever_processed)[rows]
                        rows, x, q = rows[keep], x[keep], q[keep]
                        if not bool(keep.all()):
                            key_end = int(rows.max()) + 1
                block_k, block_v = store_k[layer][:key_end], store_v[layer][:key_end]
                keys = torch.cat([prefix_k[layer], block_k]) if committed else block_k
                values = torch.cat([prefix_v[layer], block_v]) if committed else block_v
                visible = torch.ones(len(rows), keys.shape[0], dtype=torch.bool)
                x = attend_and_mlp(model, x, q, keys, values, visible, layer)
            logits = rms_norm(x, w["model.norm.weight"], model.eps) @ w["lm_head.weight"].T
            logits[:, mask_id] = float("-inf")
            probs = logits.float().softmax(-1)
            confidence = torch.full((block_size,), float("-inf"))
            proposal = torch.full((block_size,), mask_id)
            confidence[rows], proposal[rows] = probs.max(-1)
            eligible = torch.zeros(block_size, dtype=torch.bool)
            eligible[rows] = True
            commit = choose_commits(confidence, masked & eligible, step, block_size,
                                    StandardPolicyConfig(config.strategy, config.threshold,
                                                         config.denoising_steps))
            block = torch.where(commit, proposal, block)
            cache.update(masked)
            ever_processed |= eligible
            decoded_steps, decoded_tokens, step = decoded_steps + 1, decoded_tokens + int(commit.sum()), step + 1
            assert step <= 64 * steps_cap
        for position, token in enumerate(block.tolist(), start=start):
            if position < len(prompt):
                continue
            output.append(token)
            if token in stop_token_ids or len(output) == max_tokens:
                return output
        committed += block.tolist()
        start += block_size
        block = torch.full((block_size,), mask_id)
