"""A plain-PyTorch reference of FOCUS on a model whose logits are shifted (Fast-dLLM v2's
form: block position j is read from row j - 1), greedy, exact commit, one sequence.

The model's forward is Fast-dLLM v2's (``reference_fast_dllm_v2``: Qwen2 layers under the
block-causal mask, a cache of the committed blocks); its block loop without sub-blocks:
the prompt's whole blocks are encoded, a completed block is encoded once more and its
last row's argmax is the next block's first token. Each denoising step runs the block's
processed rows layer by layer, keys and values in a per-layer block store; queries attend
to the committed cache and the block store.

FOCUS (the pieces of ``reference_focus``: importance, budget, retained set, neighbour
cache) applied to the positions the rows decode. These are choices the paper does not
make (its models' rows predict their own positions); they are the ones the engine makes:

- the processed rows: all of the block's at its first step, then those the neighbour
  cache has not frozen, the cache deciding rows (a row is frozen once its token and the
  one after it were decoded before a step);
- each processed row but the last decodes the position after it; the candidates are the
  masked decoded positions, and a candidate's importance (layers 0 and 1) is that of the
  row that decodes it, among the candidates' rows;
- at layer 1 the retained set is chosen over the decoded positions (ever-processed
  meaning: decoded by a row at an earlier step of the block); where it differs from
  the decoded positions, only the rows before retained positions continue (the last row,
  which decodes the next block's first position, stops too), and from layer 1's attention
  on the block's keys stop after the rightmost continuing row;
- the running mean of tokens decoded per step counts every step of the request,
  including the steps that read a block's first token from the previous block's commit.
"""

from __future__ import annotations

import math

import torch
from reference_fast_dllm_v2 import ReferenceFastDLLMv2, mask_banned
from reference_focus import NeighbourCache, budget_k, importance, proposals, retained_set
from reference_dream import rms_norm
from reference_sdar import select_positions, transfer_quotas


def _project(model: ReferenceFastDLLMv2, x: torch.Tensor, positions: torch.Tensor,
             layer: int):
    """q [n, H, D], k [n, Hkv, D], v [n, Hkv, D] of rows ``x`` at ``positions``."""
    prefix = f"model.layers.{layer}."
    n = x.shape[0]
    h = rms_norm(x, model.weights[prefix + "input_layernorm.weight"], model.eps)
    q = model._linear(h, prefix + "self_attn.q_proj").view(n, model.num_heads, model.head_dim)
    k = model._linear(h, prefix + "self_attn.k_proj").view(n, model.num_kv_heads, model.head_dim)
    v = model._linear(h, prefix + "self_attn.v_proj").view(n, model.num_kv_heads, model.head_dim)
    q = model._rope(q.transpose(0, 1), positions).transpose(0, 1)
    k = model._rope(k.transpose(0, 1), positions).transpose(0, 1)
    return q, k, v


def _attend_and_mlp(model, x, q, keys, values, layer):
    """Finish layer ``layer`` for rows ``x``: every key in ``keys`` is visible."""
    prefix = f"model.layers.{layer}."
    group = model.num_heads // model.num_kv_heads
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, K, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q.transpose(0, 1) @ k.transpose(1, 2)) / math.sqrt(model.head_dim)
    out = scores.softmax(-1) @ v  # [H, n, D]
    x = x + model._linear(out.transpose(0, 1).reshape(x.shape[0], -1),
                          prefix + "self_attn.o_proj")
    return model._feed_forward(x, prefix)


def _visible_keys(store_k, store_v, past, layer: int, key_end: int):
    """[K, Hkv, D] keys and values a block row sees at ``layer``: the committed cache's
    (``past``: per layer [Hkv, L, D] pairs, or None) and the block store's first
    ``key_end`` positions (per layer [Hkv, B, D])."""
    keys = store_k[layer][:, :key_end]
    values = store_v[layer][:, :key_end]
    if past is not None:
        keys = torch.cat([past[layer][0], keys], dim=1)
        values = torch.cat([past[layer][1], values], dim=1)
    return keys.transpose(0, 1), values.transpose(0, 1)


def forward_rows(model: ReferenceFastDLLMv2, block: torch.Tensor, rows: torch.Tensor,
                 start: int, past, store_k: list, store_v: list,
                 key_end: int) -> torch.Tensor:
    """The block's ``rows`` (their tokens) through every layer, writing their keys and
    values into the per-layer block stores ([Hkv, B, D]) and attending to the past and the
    stores' first ``key_end`` positions; returns the last layer's output of the rows."""
    x = model.weights["model.embed_tokens.weight"][block[rows]]
    for layer in range(model.config["num_hidden_layers"]):
        q, k, v = _project(model, x, start + rows, layer)
        store_k[layer][:, rows] = k.transpose(0, 1)
        store_v[layer][:, rows] = v.transpose(0, 1)
        keys, values = _visible_keys(store_k, store_v, past, layer, key_end)
        x = _attend_and_mlp(model, x, q, keys, values, layer)
    return x


@torch.no_grad()
def reference_focus_shifted_generate(model: ReferenceFastDLLMv2, prompt: list[int], *,
                                     block_size: int, mask_id: int, max_tokens: int,
                                     config) -> list[int]:
    """``config``: a FocusConfig (strategy, threshold, alpha, pool_kernel, evict,
    intra_block_cache, denoising_steps); greedy, exact commit, no stop token."""
    num_layers = model.config["num_hidden_layers"]
    steps_cap = config.denoising_steps or block_size
    quotas = transfer_quotas(block_size, steps_cap)
    stats = {"steps": 0, "tokens": 0}  # over the request (the across-blocks mean)

    def count(decoded: int) -> None:
        stats["steps"] += 1
        stats["tokens"] += decoded

    def denoise(block: torch.Tensor, past) -> torch.Tensor:
        start = 0 if past is None else past[0][0].shape[1]
        store_k = [torch.zeros(model.num_kv_heads, block_size, model.head_dim)
                   for _ in range(num_layers)]  # per layer [Hkv, B, D]
        store_v = [torch.zeros_like(k) for k in store_k]
        cache, ever_processed, step = NeighbourCache(block_size), [False] * block_size, 0
        while bool((block == mask_id).any()):
            masked = block == mask_id
            processed = (torch.tensor(cache.processing()) if config.intra_block_cache
                         else torch.ones(block_size, dtype=torch.bool))
            rows = torch.nonzero(processed).flatten()  # row positions computed, ascending
            decodes = rows + 1  # the position each row decodes (the last one's is unused)
            decoding = torch.zeros(block_size, dtype=torch.bool)  # decoded positions
            decoding[decodes[:-1]] = True
            x = model.weights["model.embed_tokens.weight"][block[rows]]
            layer_importance, key_end = [], block_size
            for layer in range(num_layers):
                q, k, v = _project(model, x, start + rows, layer)
                store_k[layer][:, rows], store_v[layer][:, rows] = k.transpose(0, 1), \
                    v.transpose(0, 1)
                if layer < 2:
                    candidate_rows = torch.tensor(
                        [i for i, r in enumerate(rows.tolist())
                         if r + 1 < block_size and bool(masked[r + 1])
                         and bool(decoding[r + 1])], dtype=torch.long)
                    layer_importance.append(importance(
                        q[candidate_rows], k[candidate_rows], model.head_dim ** -0.5,
                        config.pool_kernel))
                if layer == 1 and config.evict and bool((masked & decoding).any()):
                    delta = [0.0] * block_size
                    candidates = torch.nonzero(masked & decoding).flatten().tolist()
                    for i, d in zip(candidates,
                                    (layer_importance[1] - layer_importance[0]).tolist()):
                        delta[i] = d
                    mean = stats["tokens"] / stats["steps"] if stats["steps"] else 1.0
                    k_budget = budget_k([delta[i] for i in candidates], mean, config.alpha,
                                        block_size)
                    if k_budget < len(candidates):
                        retained = torch.tensor(retained_set(
                            delta, masked.tolist(), k_budget, decoding.tolist(),
                            ever_processed))
                        if not bool((retained == decoding).all()):
                            keep = torch.tensor([r + 1 < block_size and bool(retained[r + 1])
                                                 for r in rows.tolist()])
                            rows, x, q = rows[keep], x[keep], q[keep]
                            key_end = int(torch.nonzero(retained).max())  # last row + 1
                keys, values = _visible_keys(store_k, store_v, past, layer, key_end)
                x = _attend_and_mlp(model, x, q, keys, values, layer)
            # the continuing rows that decode a position of the block (not the last row)
            read = torch.tensor([r + 1 < block_size and bool(decoding[r + 1])
                                 for r in rows.tolist()], dtype=torch.bool)
            confidence, proposal = proposals(model._logits(x[read]), rows[read] + 1,
                                             block_size, mask_id)
            eligible = torch.zeros(block_size, dtype=torch.bool)
            eligible[rows[read] + 1] = True
            quota = quotas[step] if step < steps_cap else block_size
            candidates = masked & eligible
            confidence = torch.where(candidates, confidence,
                                     torch.full_like(confidence, float("-inf")))
            commit = select_positions(config.strategy, confidence, candidates, quota,
                                      config.threshold, last_step=step >= steps_cap - 1)
            block = torch.where(commit, proposal, block)
            cache.after_step(masked.tolist())
            ever_processed = [e or bool(g) for e, g in zip(ever_processed, eligible)]
            count(int(commit.sum()))
            step += 1
            assert step <= 64 * steps_cap
        return block

    return generate_by_shifted_blocks(model, prompt, block_size, mask_id, max_tokens,
                                      denoise, on_first_token=lambda: count(1))


def generate_by_shifted_blocks(model: ReferenceFastDLLMv2, prompt: list[int], block_size: int,
                               mask_id: int, max_tokens: int, denoise, on_first_token=None
                               ) -> list[int]:
    """Fast-dLLM v2's block loop: the prompt's whole blocks encoded into the cache (where
    the prompt ends on a block boundary, the last row's argmax is the next block's first
    token), then per block ``denoise(block, past)`` (the block with its known tokens,
    masks after them) until it is decoded, its encoding into the cache, and its last row's
    argmax as the next block's first token. ``on_first_token()`` is called at each first
    token read so. Returns ``max_tokens`` output tokens."""

    def first_token(logits: torch.Tensor) -> int:
        if on_first_token is not None:
            on_first_token()
        return int(mask_banned(logits[-1], mask_id).argmax())

    ids, past = list(prompt), None
    whole = len(prompt) // block_size * block_size
    if whole:
        logits, past = model(ids[:whole], None, block_size, update=True)
        if whole == len(prompt):
            ids.append(first_token(logits))
    while len(ids) - len(prompt) < max_tokens:
        start = len(ids) // block_size * block_size
        block = torch.tensor(ids[start:] + [mask_id] * (block_size - len(ids) % block_size))
        block = denoise(block, past)
        ids = ids[:start] + block.tolist()
        logits, past = model(block.tolist(), past, block_size, update=True)
        ids.append(first_token(logits))
    return ids[len(prompt):len(prompt) + max_tokens]
