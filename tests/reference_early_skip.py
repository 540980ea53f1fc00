"""Plain-PyTorch references of ES-dLLM (early skipping) and Ada-DLM (adaptive freezing)
decoding on the SDAR reference, greedy, exact commit, one request, no paging.

Written from the papers (ES-dLLM Eq. 1, Algorithm 1 and Appendix B; Ada-DLM section 4.2
and Algorithm 1) and, for ES-dLLM's safeguards, the authors' released generation loop
(zhuzj19/ES-dLLM: the keep floor, the importance bonuses, the cache update of survivors
only), with plain loops, independently of the package; the layer-by-layer machinery
(per-layer block KV stores that persist across the steps of a block, exact prefix KV)
is the FOCUS reference's.

Choices neither paper makes, encoded here as the engine makes them:
- ES-dLLM: the block refresh counts the steps of the block, and the block's first step
  computes everything (the authors count steps over the whole generation and compute
  every future block in their first forward); the keep floor uses the request's own
  decoded count (the authors': the batch maximum); without the bonuses the most confident
  masked position always continues; ties go to the left.
- Ada-DLM: a frozen position commits its proposal at once; when K >= m the lowest-ranked
  masked position is the boundary prototype; the top-ranked position always freezes.
"""

from __future__ import annotations

import math

import torch
from reference_focus import (NeighbourCache, attend_and_mlp, block_stores, generate_by_blocks,
                             prefix_kv, project, proposals)
from reference_sdar import ReferenceSDAR, rms_norm, select_positions, transfer_quotas


def es_importance(hidden: list[torch.Tensor], previous: list[torch.Tensor],
                  confidence: list[float], alpha: float) -> list[float]:
    """Eq. 1 per position: alpha * c_prev + (1 - alpha) * ||dH||_1 / (sqrt(d) ||H'||_2),
    the variation divided by its maximum when that is above 1 (the authors' code)."""
    changes = []
    for h, p in zip(hidden, previous):
        d = h.shape[0]
        changes.append(float(sum(abs(float(a) - float(b)) for a, b in zip(h, p)))
                       / (math.sqrt(d) * (float(p.norm()) + 1e-6)))
    scale = max(max(changes), 1.0)
    return [alpha * c + (1 - alpha) * v / scale for c, v in zip(confidence, changes)]


def es_keep_count(num_computed: int, depth: int, skip_ratio: float, decoded_last: int,
                  keep_floor: bool) -> int:
    """The authors' token count after the ``depth``-th skip layer: the cumulative share
    (1 - r)^depth of the positions in the forward, at least min(decoded + 2, n) with the
    floor, at least one. The paper's arithmetic is exact, so float error is rounded off."""
    count = int((1 - skip_ratio) ** depth * num_computed + 1e-9)
    if keep_floor:
        count = max(count, min(decoded_last + 2, num_computed))
    return max(count, 1)


def es_keep(importance: list[float], masked: list[bool], confidence: list[float],
            count: int, bonuses: list[float] | None, alpha: float) -> list[bool]:
    """The top ``count`` by importance (ties to the left). ``bonuses``: the authors'
    position bonuses (leftmost mask 5, decoded by the previous step 3) of these entries,
    to which the two most confident entries add 2 when alpha > 0; None: no bonuses, and
    the most confident masked entry always continues."""
    n = len(importance)
    scores = list(importance)
    if bonuses is not None:
        scores = [a + b for a, b in zip(scores, bonuses)]
        if alpha > 0:
            for i in sorted(range(n), key=lambda i: (-confidence[i], i))[:2]:
                scores[i] += 2.0
    else:
        masked_items = [i for i in range(n) if masked[i]]
        if masked_items:
            best = max(masked_items, key=lambda i: (confidence[i], -i))
            scores[best] = float("inf")
    order = sorted(range(n), key=lambda i: (-scores[i], i))
    keep = [False] * n
    for i in order[:count]:
        keep[i] = True
    return keep


def _block_forward(model: ReferenceSDAR, block: torch.Tensor, rows: torch.Tensor, start: int,
                   prefix, stores, on_layer_output=None):
    """Run block positions ``rows`` through every layer; ``on_layer_output(layer, rows, x)``
    may return a [len(rows)] bool of the rows that continue. Returns (rows, logits)."""
    w = model.weights
    x = w["model.embed_tokens.weight"][block[rows]]
    store_k, store_v = stores
    for layer in range(model.num_layers):
        q, k, v = project(model, x, start + rows, layer)
        store_k[layer][rows], store_v[layer][rows] = k, v
        keys, values = store_k[layer], store_v[layer]
        if prefix is not None:
            keys = torch.cat([prefix[0][layer], keys])
            values = torch.cat([prefix[1][layer], values])
        visible = torch.ones(len(rows), keys.shape[0], dtype=torch.bool)
        x = attend_and_mlp(model, x, q, keys, values, visible, layer)
        if on_layer_output is not None:
            keep = on_layer_output(layer, rows, x)
            if keep is not None:
                rows, x = rows[keep], x[keep]
    logits = rms_norm(x, w["model.norm.weight"], model.eps) @ w["lm_head.weight"].T
    return rows, logits


@torch.no_grad()
def reference_es_generate(model: ReferenceSDAR, prompt: list[int], *, block_size: int,
                          mask_id: int, max_tokens: int, strategy: str, threshold: float,
                          alpha: float, skip_ratio: float, skip_layers: tuple[int, ...],
                          refresh_period: int | None = 4, keep_floor: bool = True,
                          priority_bonuses: bool = True, denoising_steps: int | None = None,
                          stop_token_ids=frozenset()) -> list[int]:
    steps_cap = denoising_steps or block_size
    quotas = transfer_quotas(block_size, steps_cap)

    def decode_block(start, committed, block):
        prefix = prefix_kv(model, committed, block_size) if committed else None
        stores = block_stores(model, block_size)
        hidden_cache: dict[int, list[torch.Tensor]] = {}
        c_prev = [0.0] * block_size
        decoded_last = [False] * block_size
        step = 0
        while bool((block == mask_id).any()):
            masked = (block == mask_id).tolist()
            full = (step == 0 or skip_ratio == 0
                    or (refresh_period is not None and step % refresh_period == 0)
                    or step >= steps_cap - 1)
            leftmost = masked.index(True)
            bonus = [0.0] * block_size
            bonus[leftmost] += 5.0
            if alpha < 1:
                for p in range(block_size):
                    bonus[p] += 3.0 if decoded_last[p] else 0.0

            def on_layer_output(layer, rows, x):
                if layer not in skip_layers:
                    return None
                positions = rows.tolist()
                cache = hidden_cache.setdefault(
                    layer, [torch.zeros(x.shape[1]) for _ in range(block_size)])
                if full:
                    for p, h in zip(positions, x):
                        cache[p] = h.clone()
                    return None
                previous = [cache[p] for p in positions]
                scores = es_importance(list(x), previous, [c_prev[p] for p in positions], alpha)
                count = es_keep_count(block_size, skip_layers.index(layer) + 1, skip_ratio,
                                      sum(decoded_last), keep_floor)
                keep = es_keep(scores, [masked[p] for p in positions],
                               [c_prev[p] for p in positions], count,
                               [bonus[p] for p in positions] if priority_bonuses else None,
                               alpha)
                for p, h, k in zip(positions, x, keep):
                    if k:  # only the survivors' outputs are cached (the authors' code)
                        cache[p] = h.clone()
                return torch.tensor(keep)

            rows, logits = _block_forward(model, block, torch.arange(block_size), start,
                                          prefix, stores, on_layer_output)
            confidence, proposal = proposals(logits, rows, block_size, mask_id)
            computed = torch.zeros(block_size, dtype=torch.bool)
            computed[rows] = True
            candidates = torch.tensor(masked) & computed
            quota = quotas[step] if step < steps_cap else block_size
            scored = torch.where(candidates, confidence, torch.full_like(confidence, float("-inf")))
            commit = select_positions(strategy, scored, candidates, quota, threshold,
                                      last_step=step >= steps_cap - 1)
            for p in rows.tolist():
                still_masked = masked[p] and not bool(commit[p])
                c_prev[p] = float(confidence[p]) if still_masked else 0.0
            decoded_last = commit.tolist()
            block = torch.where(commit, proposal, block)
            step += 1
            assert step <= 4 * block_size
        return block

    return generate_by_blocks(prompt, block_size, mask_id, max_tokens, stop_token_ids,
                              decode_block)


def ada_freeze(confidence: list[float], masked: list[bool], history: list[list[float]],
               capacity: float, confidence_floor: float = 0.0,
               static_threshold: float | None = None) -> list[bool]:
    """Ada-DLM's decision over one block: rank by confidence, K = ceil(capacity * B) fixed
    by the block size B, prototypes rho(1) and rho(K+1) (the lowest-ranked when K >= m),
    freeze where d_high < d_bound, and always freeze rho(1). ``confidence_floor`` and
    ``static_threshold`` are not the paper's (0 and None leave its rule): a position below
    the floor this step is not frozen unless it is rho(1); a masked position above the
    static threshold is frozen whatever its cluster."""
    candidates = [i for i in range(len(masked)) if masked[i]]
    frozen = [False] * len(masked)
    if not candidates:
        return frozen
    ranked = sorted(candidates, key=lambda i: (-confidence[i], i))
    m = len(ranked)
    k = max(1, math.ceil(capacity * len(masked) - 1e-9))
    high = history[ranked[0]]
    bound = history[ranked[k]] if k < m else history[ranked[m - 1]]
    for i in candidates:
        d_high = sum((a - b) ** 2 for a, b in zip(history[i], high))
        d_bound = sum((a - b) ** 2 for a, b in zip(history[i], bound))
        frozen[i] = d_high < d_bound and confidence[i] >= confidence_floor
        if static_threshold is not None and confidence[i] > static_threshold:
            frozen[i] = True
    frozen[ranked[0]] = True
    return frozen


@torch.no_grad()
def reference_ada_generate(model: ReferenceSDAR, prompt: list[int], *, block_size: int,
                           mask_id: int, max_tokens: int, capacity: float, history: int,
                           intra_block_cache: bool = True,
                           freeze_rule: str = "after_recompute",
                           confidence_floor: float = 0.0,
                           static_threshold: float | None = None,
                           stop_token_ids=frozenset()) -> list[int]:
    """``freeze_rule``, when a decoded position stops being computed: "after_recompute"
    (after one step computed it with its token: the paper's frozen tokens skip the FFN but
    stay visible to attention, which exact KV caching can only approximate so),
    "immediate" (never again) or "after_neighbour" (FOCUS's rule, not the paper's)."""
    def decode_block(start, committed, block):
        prefix = prefix_kv(model, committed, block_size) if committed else None
        stores = block_stores(model, block_size)
        cache = NeighbourCache(block_size)
        stopped = [False] * block_size  # positions no longer computed in this block
        trajectory = [[0.0] * history for _ in range(block_size)]
        steps = 0
        while bool((block == mask_id).any()):
            masked = (block == mask_id).tolist()
            if not intra_block_cache:
                processing = [True] * block_size
            elif freeze_rule in ("immediate", "after_recompute"):
                processing = ([True] * block_size if steps == 0 or all(stopped)
                              else [not d for d in stopped])
            else:
                processing = cache.processing()
            rows = torch.nonzero(torch.tensor(processing)).flatten()
            rows, logits = _block_forward(model, block, rows, start, prefix, stores)
            confidence, proposal = proposals(logits, rows, block_size, mask_id)
            for i in range(block_size):
                if masked[i]:
                    trajectory[i] = [float(confidence[i])] + trajectory[i][:-1]
            frozen = ada_freeze(confidence.tolist(), masked, trajectory, capacity,
                                confidence_floor, static_threshold)
            block = torch.where(torch.tensor(frozen), proposal, block)
            if freeze_rule == "immediate":  # decoded now or before (prompt positions too)
                stopped = (block != mask_id).tolist()
            else:  # decoded before this step, so computed in it with the token
                stopped = [s or not m for s, m in zip(stopped, masked)]
            cache.after_step(masked)
            steps += 1
            assert steps <= block_size
        return block

    return generate_by_blocks(prompt, block_size, mask_id, max_tokens, stop_token_ids,
                              decode_block)
