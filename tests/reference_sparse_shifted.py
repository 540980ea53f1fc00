"""A plain-PyTorch reference of Sparse-dLLM's prefix-sparse decoding on a model whose
logits are shifted (Fast-dLLM v2's form: block position j is read from row j - 1), greedy,
one sequence.

The model, its block loop and the projections are ``reference_focus_shifted``'s; the
selection of the kept prefix positions is ``reference_sparse_prefix.select_kept`` (mean
query per head over the block's rows, scaled dot products with the committed prefix keys,
mean over the heads -- or over each KV head's group -- max-pool of kernel s, top
floor(r * N)). Choices the paper (on LLaDA and Dream's dual cache) does not make, as the
engine makes them:

- every denoising step computes the whole block; rows 0..B-2 decode positions 1..B-1, the
  block's first position being read from the previous block's commit (Fast-dLLM v2's
  loop), which attends densely (committed KV stays exact) and is not one of the block's
  steps: the steps counted against ``delay_steps`` are the block's denoising steps;
- step ``delay_steps`` attends densely and selects, every layer, from the queries of all
  the block's rows; later steps attend to the kept prefix positions plus the block.
"""

from __future__ import annotations

import math

import torch
from reference_fast_dllm_v2 import ReferenceFastDLLMv2
from reference_focus import proposals
from reference_focus_shifted import _project, generate_by_shifted_blocks
from reference_sdar import select_positions, transfer_quotas
from reference_sparse_prefix import select_kept


def _attend_and_mlp(model, x, q, keys, values, visible, layer):
    """Finish layer ``layer`` for rows ``x`` (q [n, H, D]); keys, values [K, Hkv, D];
    visible: [Hkv, K] the keys each KV head sees."""
    prefix = f"model.layers.{layer}."
    group = model.num_heads // model.num_kv_heads
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, K, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    mask = visible.repeat_interleave(group, dim=0)[:, None, :]  # [H, 1, K]
    scores = (q.transpose(0, 1) @ k.transpose(1, 2)) / math.sqrt(model.head_dim)
    out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v  # [H, n, D]
    x = x + model._linear(out.transpose(0, 1).reshape(x.shape[0], -1),
                          prefix + "self_attn.o_proj")
    return model._feed_forward(x, prefix)


@torch.no_grad()
def reference_sparse_shifted_generate(model: ReferenceFastDLLMv2, prompt: list[int], *,
                                      block_size: int, mask_id: int, max_tokens: int,
                                      strategy: str, threshold: float,
                                      retention_ratio: float, pool_kernel: int,
                                      delay_steps: int, per_kv_head: bool) -> list[int]:
    """Greedy, no stop token; ``max_tokens`` output tokens."""
    num_layers = model.config["num_hidden_layers"]
    quotas = transfer_quotas(block_size, block_size)
    rows = torch.arange(block_size)

    def denoise(block: torch.Tensor, past) -> torch.Tensor:
        start = 0 if past is None else past[0][0].shape[1]
        keep = math.floor(retention_ratio * start)
        kept: list = []  # per layer, per KV head: the kept prefix positions
        step = 0
        while bool((block == mask_id).any()):
            masked = block == mask_id
            selecting = start > 0 and step == delay_steps
            sparse = start > 0 and step > delay_steps
            x = model.weights["model.embed_tokens.weight"][block]
            for layer in range(num_layers):
                q, k, v = _project(model, x, start + rows, layer)  # [B, H(kv), D]
                keys, values = k, v
                visible = torch.ones(model.num_kv_heads, start + block_size,
                                     dtype=torch.bool)
                if past is not None:
                    prefix_k = past[layer][0].transpose(0, 1)  # [N, Hkv, D]
                    keys = torch.cat([prefix_k, k])
                    values = torch.cat([past[layer][1].transpose(0, 1), v])
                    if selecting:
                        kept.append(select_kept(q, prefix_k, model.head_dim ** -0.5, keep,
                                                pool_kernel, per_kv_head))
                    elif sparse:
                        visible[:, :start] = False
                        for head, positions in enumerate(kept[layer]):
                            visible[head, positions] = True
                x = _attend_and_mlp(model, x, q, keys, values, visible, layer)
            confidence, proposal = proposals(model._logits(x[:-1]), rows[:-1] + 1,
                                             block_size, mask_id)
            quota = quotas[step] if step < block_size else block_size
            scored = torch.where(masked, confidence, torch.full_like(confidence,
                                                                     float("-inf")))
            commit = select_positions(strategy, scored, masked, quota, threshold,
                                      last_step=step >= block_size - 1)
            block = torch.where(commit, proposal, block)
            step += 1
            assert step <= block_size
        return block

    return generate_by_shifted_blocks(model, prompt, block_size, mask_id, max_tokens,
                                      denoise)
