"""Plain-PyTorch reference of LLaDA2.2, written from the published description
(``../shared/notes/llada22.md``: the tech report and three ports checked against the
reference code) independently of the package.

The forward is LLaDA2's (``reference_llada2``) with block routing in every MoE layer:
per routing block (``block_size`` tokens by absolute position), each expert's block score
is the largest sigmoid-plus-bias score over the block's tokens; the ``expert_capacity``
best experts (ties: the lower id, as the ports) form the pool; each token takes its top-k
by biased score within the pool, weighted by the unbiased scores renormalised (k > 1,
eps 1e-20) times ``routed_scaling_factor``.

The decoding loop (``reference_generate_joint``) is the published joint loop, greedy, on
the cache-free forward. Choices the sources do not make, made as the engine makes them:
the mask token is never proposed (excluded before the arg-max); at the step cap the step
is a final round and the block ends (the ports raise an error there).
"""

from __future__ import annotations

import random

import torch
from reference_llada2 import ReferenceLLaDA2


def reference_block_route(logits: torch.Tensor, positions: torch.Tensor,
                          expert_bias: torch.Tensor, top_k: int, capacity: int,
                          block_size: int, scaling: float):
    """Per token (loops): (weights [T, k], experts [T, k]) from fp32 logits [T, E] of the
    rows at ``positions`` [T]: one request's rows in increasing position, the next
    request's starting where the position does not increase (the engine's layout)."""
    scores = torch.sigmoid(logits.float())
    biased = scores + expert_bias.float()
    request, blocks = 0, []
    for i, position in enumerate(positions.tolist()):
        if i and position <= positions[i - 1]:
            request += 1
        blocks.append((request, position // block_size))
    pools = {}
    for block in set(blocks):
        rows = [i for i, b in enumerate(blocks) if b == block]
        best = [max(float(biased[i, e]) for i in rows) for e in range(logits.shape[1])]
        order = sorted(range(len(best)), key=lambda e: (-best[e], e))
        pools[block] = set(order[:capacity])
    weights, experts = [], []
    for i, block in enumerate(blocks):
        allowed = sorted(pools[block], key=lambda e: (-float(biased[i, e]), e))
        chosen = torch.tensor(allowed[:top_k])
        w = scores[i, chosen]
        if top_k > 1:
            w = w / (w.sum() + 1e-20)
        weights.append(w * scaling)
        experts.append(chosen)
    return torch.stack(weights), torch.stack(experts)


class ReferenceLLaDA22(ReferenceLLaDA2):
    """LLaDA2's reference forward with block routing (token i at position i)."""

    def _route(self, logits, expert_bias):
        cfg = self.config
        return reference_block_route(logits, torch.arange(logits.shape[0]), expert_bias,
                                     cfg["num_experts_per_tok"], cfg["expert_capacity"],
                                     cfg["block_size"], cfg["routed_scaling_factor"])


def apply_edits(tokens, old, original, delete, split, mask_id):
    """DELETE drops a position; SPLIT at i gives a new mask, then old[i]; cut or padded
    with new masks to the length. Lists in, (tokens, original, source) lists out."""
    out, tracked, source = [], [], []
    for i, token in enumerate(tokens):
        if token == delete:
            continue
        if token == split:
            out += [mask_id, old[i]]
            tracked += [False, original[i]]
            source += [-1, i]
        else:
            out.append(token)
            tracked.append(original[i])
            source.append(i)
    size = len(tokens)
    out, tracked, source = out[:size], tracked[:size], source[:size]
    pad = size - len(out)
    return out + [mask_id] * pad, tracked + [False] * pad, source + [-1] * pad


@torch.no_grad()
def reference_generate_joint(model, prompt_ids, *, block_size: int, mask_id: int,
                             delete: int, split: int, max_tokens: int, threshold: float,
                             editing_threshold: float | None, max_post_steps: int,
                             steps: int | None = None, max_steps_per_block: int = 1000,
                             stop_token_ids=frozenset(), seed: int = 0):
    """LLaDA2.2's joint loop, greedy. Returns (output tokens, step map, anti-loop fired):
    a token's step is the step (counted over the request) that last wrote it."""
    from reference_sdar import block_causal_mask

    steps = steps or block_size
    prompt_len = len(prompt_ids)
    start = prompt_len // block_size * block_size
    committed = list(prompt_ids[:start])
    output, step_map, forwards, fired = [], [], 0, False
    rng = random.Random(seed)
    while True:
        tail = list(prompt_ids[start:]) if start < prompt_len else []
        block = tail + [mask_id] * (block_size - len(tail))
        fixed = [i < len(tail) for i in range(block_size)]
        original = [not f for f in fixed]
        written_at = [-1] * block_size
        count = sum(original)
        schedule = [count // steps + int(i < count % steps) for i in range(steps)]
        seen, post, step = set(), 0, 0
        while True:
            old = list(block)
            masks = [t == mask_id and not fixed[i] for i, t in enumerate(old)]
            original_left = sum(m and o for m, o in zip(masks, original))
            mask_count = sum(masks)
            post = post + 1 if original_left == 0 else 0
            if (mask_count == 0 and post > max_post_steps) or step >= max_steps_per_block:
                break
            tokens = torch.tensor(committed + old)
            logits = model.forward(tokens, block_causal_mask(len(tokens), block_size))
            logits = logits[-block_size:].float()
            logits[:, mask_id] = float("-inf")
            probs = logits.softmax(-1)
            confidence, greedy = probs.max(-1)
            ranked = logits.argsort(dim=-1, descending=True)[:, :3].tolist()
            confidence, greedy = confidence.tolist(), greedy.tolist()
            fill = [False] * block_size
            if mask_count:
                if step < steps:
                    need = schedule[step] + mask_count - original_left
                    high = [i for i in range(block_size) if masks[i] and confidence[i] > threshold]
                    if len(high) >= need:
                        for i in high:
                            fill[i] = True
                    else:
                        order = sorted((i for i in range(block_size) if masks[i]),
                                       key=lambda i: (-confidence[i], i))
                        for i in order[:need]:
                            fill[i] = True
                else:
                    fill = list(masks)
            edits = [editing_threshold is not None and not masks[i] and not fixed[i]
                     and confidence[i] > editing_threshold and greedy[i] != old[i]
                     for i in range(block_size)]
            if max_post_steps > 0:
                final = post >= max_post_steps
            else:
                final = original_left > 0 and all(fill[i] for i in range(block_size)
                                                   if masks[i] and original[i])
            final = final or step + 1 >= max_steps_per_block
            if final:
                fill = list(masks)
            new = list(old)
            for i in range(block_size):
                if fill[i] or edits[i]:
                    new[i] = greedy[i]
                    if final and new[i] in (delete, split):
                        new[i] = next(t for t in ranked[i] if t not in (delete, split))
            if not final and (any(fill) or any(edits)) and tuple(new) in seen:
                fired = True  # the anti-loop: up to 5 random changes take their next best
                for _ in range(5):
                    changed = [i for i in range(block_size) if new[i] != old[i]]
                    if not changed:
                        break
                    i = changed[rng.randrange(len(changed))]
                    new[i] = next(t for t in ranked[i] if t != new[i])
                    if tuple(new) not in seen:
                        break
            seen.add(tuple(new))
            for i in range(block_size):
                if new[i] != old[i] and new[i] not in (delete, split):
                    written_at[i] = forwards
            block, original, source = apply_edits(new, old, original, delete, split, mask_id)
            written_at = [written_at[s] if s >= 0 else -1 for s in source]
            forwards += 1
            step += 1
            if block == old and mask_id not in block:
                break
        assert mask_id not in block and delete not in block and split not in block
        for offset, token in enumerate(block):
            if start + offset < prompt_len:
                continue
            output.append(token)
            step_map.append(written_at[offset])
            if token in stop_token_ids or len(output) == max_tokens:
                return output, step_map, fired
        committed += block
        start += block_size
