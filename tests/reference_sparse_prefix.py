"""Plain-PyTorch reference of Sparse-dLLM's prefix-sparse decoding (Algorithms 4-5, the
prefix side) on the SDAR reference, greedy, exact commit, one request, no paging.

Written from the paper with plain loops, independently of the package. Per block starting
at N: steps before ``delay_steps`` attend densely; at step ``delay_steps`` every layer
attends densely and its block queries select the kept prefix positions (mean query per
head, scaled dot products with the prefix keys, mean over the heads -- or over the heads of
each KV head's group -- max-pool of kernel s, top floor(r * N), ties to the earlier
position); later steps of the block attend to the kept prefix positions plus the block.
"""

from __future__ import annotations

import math

import torch
from reference_focus import block_stores, generate_by_blocks, prefix_kv, project, proposals
from reference_sdar import ReferenceSDAR, rms_norm, select_positions, transfer_quotas


def select_kept(q: torch.Tensor, prefix_keys: torch.Tensor, scale: float, keep: int,
                kernel: int, per_kv_head: bool) -> list[list[int]]:
    """Kept prefix positions per KV head ([H_kv] lists; one list repeated when shared).
    q: [B, H, D] the block's queries; prefix_keys: [N, H_kv, D]."""
    heads, kv_heads = q.shape[1], prefix_keys.shape[1]
    group = heads // kv_heads
    mean_q = q.double().mean(0)  # [H, D]
    per_head = [[float(mean_q[h] @ prefix_keys[j, h // group].double()) * scale
                 for j in range(prefix_keys.shape[0])] for h in range(heads)]

    def choose(head_set):
        scores = [sum(per_head[h][j] for h in head_set) / len(head_set)
                  for j in range(prefix_keys.shape[0])]
        half = kernel // 2
        pooled = [max(scores[max(0, j - half):j + half + 1]) for j in range(len(scores))]
        return sorted(sorted(range(len(pooled)), key=lambda j: (-pooled[j], j))[:keep])

    if per_kv_head:
        return [choose(range(g * group, (g + 1) * group)) for g in range(kv_heads)]
    return [choose(range(heads))] * kv_heads


def attend_and_mlp_per_head(model, x, q, keys, values, visible, layer):
    """Finish layer ``layer`` for rows ``x``; visible: [H_kv, L] keys each KV head sees."""
    w, p = model.weights, f"model.layers.{layer}"
    group = model.num_heads // model.num_kv_heads
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    mask = visible.repeat_interleave(group, dim=0)[:, None, :]  # [H, 1, L]
    scores = (q.transpose(0, 1) @ k.transpose(1, 2)) / math.sqrt(model.head_dim)
    out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v  # [H, n, D]
    out = out.transpose(0, 1).reshape(x.shape[0], -1) @ w[f"{p}.self_attn.o_proj.weight"].T
    x = x + out
    return x + model._mlp(rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], model.eps),
                          f"{p}.mlp")


@torch.no_grad()
def reference_sparse_prefix_generate(model: ReferenceSDAR, prompt: list[int], *,
                                     block_size: int, mask_id: int, max_tokens: int,
                                     strategy: str, threshold: float, retention_ratio: float,
                                     pool_kernel: int, delay_steps: int, per_kv_head: bool,
                                     denoising_steps: int | None = None,
                                     stop_token_ids=frozenset()) -> list[int]:
    w = model.weights
    steps_cap = denoising_steps or block_size
    quotas = transfer_quotas(block_size, steps_cap)

    def decode_block(start, committed, block):
        prefix_k, prefix_v = prefix_kv(model, committed, block_size) if committed else ([], [])
        store_k, store_v = block_stores(model, block_size)
        kept: list[list[list[int]]] | None = None  # per layer, per KV head
        keep = math.floor(retention_ratio * start)
        step = 0
        rows = torch.arange(block_size)
        while bool((block == mask_id).any()):
            masked = block == mask_id
            selecting = bool(committed) and step == delay_steps
            if selecting:
                kept = []
            x = w["model.embed_tokens.weight"][block]
            for layer in range(model.num_layers):
                q, k, v = project(model, x, start + rows, layer)
                store_k[layer][:], store_v[layer][:] = k, v
                keys, values = store_k[layer], store_v[layer]
                visible = torch.ones(model.num_kv_heads, block_size, dtype=torch.bool)
                if committed:
                    keys = torch.cat([prefix_k[layer], keys])
                    values = torch.cat([prefix_v[layer], values])
                    prefix_visible = torch.ones(model.num_kv_heads, start, dtype=torch.bool)
                    if selecting:
                        kept.append(select_kept(q, prefix_k[layer], model.head_dim ** -0.5,
                                                keep, pool_kernel, per_kv_head))
                    elif step > delay_steps:
                        prefix_visible[:] = False
                        for head, positions in enumerate(kept[layer]):
                            prefix_visible[head, positions] = True
                    visible = torch.cat([prefix_visible, visible], dim=1)
                x = attend_and_mlp_per_head(model, x, q, keys, values, visible, layer)
            logits = rms_norm(x, w["model.norm.weight"], model.eps) @ w["lm_head.weight"].T
            confidence, proposal = proposals(logits, rows, block_size, mask_id)
            quota = quotas[step] if step < steps_cap else block_size
            scored = torch.where(masked, confidence, torch.full_like(confidence, float("-inf")))
            commit = select_positions(strategy, scored, masked, quota, threshold,
                                      last_step=step >= steps_cap - 1)
            block = torch.where(commit, proposal, block)
            step += 1
            assert step <= 4 * block_size
        return block

    return generate_by_blocks(prompt, block_size, mask_id, max_tokens, stop_token_ids,
                              decode_block)
