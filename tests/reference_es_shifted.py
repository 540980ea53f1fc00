"""A plain-PyTorch reference of ES-dLLM on a model whose logits are shifted (Fast-dLLM v2's
form: block position j is read from row j - 1), greedy, exact commit, one sequence.

The model, its block loop and the layer-by-layer forward are those of
``reference_focus_shifted``; the skipping pieces (Eq. 1's importance, the keep count, the
top-count choice with the authors' bonuses) are ``reference_early_skip``'s. Choices the
paper does not make (its models' rows predict their own positions), as the engine makes
them:

- every entry is a block row with the position it decodes (rows 0..B-2 decode 1..B-1):
  its importance, confidence and cached layer output are the decoded position's; the
  last row (it decodes the next block's first token) always continues;
- the leftmost-mask bonus goes to the entry decoding the leftmost mask; the just-decoded
  bonus to the entries whose rows hold the tokens the previous step decoded (the token at
  p is in the row that decodes p + 1);
- the step that reads a block's first token from the previous block's commit computes
  none of the block's rows: it is not one of the block's steps (the first of those
  computes everything, the refresh period counts from it), but its decoded position
  counts for the next step's keep floor, as the previous step's.
"""

from __future__ import annotations

import torch
from reference_early_skip import es_importance, es_keep, es_keep_count
from reference_fast_dllm_v2 import ReferenceFastDLLMv2
from reference_focus import proposals
from reference_focus_shifted import (_attend_and_mlp, _project, _visible_keys,
                                     generate_by_shifted_blocks)
from reference_sdar import select_positions, transfer_quotas


@torch.no_grad()
def reference_es_shifted_generate(model: ReferenceFastDLLMv2, prompt: list[int], *,
                                  block_size: int, mask_id: int, max_tokens: int,
                                  strategy: str, threshold: float, alpha: float,
                                  skip_ratio: float, skip_layers: tuple[int, ...],
                                  refresh_period: int | None = 4, keep_floor: bool = True,
                                  priority_bonuses: bool = True) -> list[int]:
    """Greedy, no stop token; ``max_tokens`` output tokens."""
    num_layers = model.config["num_hidden_layers"]
    steps_cap = block_size
    quotas = transfer_quotas(block_size, steps_cap)
    entries = block_size - 1  # block rows: row r decodes position r + 1

    def denoise(block: torch.Tensor, past, decoded_last: list[bool]) -> torch.Tensor:
        start = past[0][0].shape[1]
        store_k = [torch.zeros(model.num_kv_heads, block_size, model.head_dim)
                   for _ in range(num_layers)]  # per layer [Hkv, B, D]
        store_v = [torch.zeros_like(k) for k in store_k]
        hidden_cache: dict[int, list[torch.Tensor]] = {}  # layer -> per decoded position
        c_prev = [0.0] * block_size  # per decoded position
        step = 0
        while bool((block == mask_id).any()):
            masked = (block == mask_id).tolist()
            full = (step == 0 or skip_ratio == 0
                    or (refresh_period is not None and step % refresh_period == 0)
                    or step >= steps_cap - 1)
            bonus = [0.0] * block_size  # per decoded position
            bonus[masked.index(True)] += 5.0
            if alpha < 1:
                for p in range(block_size - 1):
                    bonus[p + 1] += 3.0 if decoded_last[p] else 0.0
            rows = torch.arange(block_size)  # all rows; entries: rows < B - 1
            x = model.weights["model.embed_tokens.weight"][block]
            for layer in range(num_layers):
                q, k, v = _project(model, x, start + rows, layer)
                store_k[layer][:, rows] = k.transpose(0, 1)
                store_v[layer][:, rows] = v.transpose(0, 1)
                keys, values = _visible_keys(store_k, store_v, past, layer, block_size)
                x = _attend_and_mlp(model, x, q, keys, values, layer)
                if layer not in skip_layers:
                    continue
                cache = hidden_cache.setdefault(
                    layer, [torch.zeros(x.shape[1]) for _ in range(block_size)])
                is_entry = rows < entries
                decoded = (rows[is_entry] + 1).tolist()  # the entries' positions
                outputs = x[is_entry]
                if full:
                    for p, h in zip(decoded, outputs):
                        cache[p] = h.clone()
                    continue
                scores = es_importance(list(outputs), [cache[p] for p in decoded],
                                       [c_prev[p] for p in decoded], alpha)
                count = es_keep_count(entries, skip_layers.index(layer) + 1, skip_ratio,
                                      sum(decoded_last), keep_floor)
                keep = es_keep(scores, [masked[p] for p in decoded],
                               [c_prev[p] for p in decoded], count,
                               [bonus[p] for p in decoded] if priority_bonuses else None,
                               alpha)
                for p, h, kept in zip(decoded, outputs, keep):
                    if kept:  # only the survivors' outputs are cached
                        cache[p] = h.clone()
                continuing = torch.ones(len(rows), dtype=torch.bool)
                continuing[is_entry] = torch.tensor(keep)
                rows, x = rows[continuing], x[continuing]
            is_entry = rows < entries
            positions = rows[is_entry] + 1
            confidence, proposal = proposals(model._logits(x[is_entry]), positions,
                                             block_size, mask_id)
            computed = torch.zeros(block_size, dtype=torch.bool)
            computed[positions] = True
            candidates = torch.tensor(masked) & computed
            quota = quotas[step] if step < steps_cap else block_size
            scored = torch.where(candidates, confidence,
                                 torch.full_like(confidence, float("-inf")))
            commit = select_positions(strategy, scored, candidates, quota, threshold,
                                      last_step=step >= steps_cap - 1)
            for p in positions.tolist():
                c_prev[p] = float(confidence[p]) if masked[p] and not bool(commit[p]) else 0.0
            decoded_last = commit.tolist()
            block = torch.where(commit, proposal, block)
            step += 1
            assert step <= 4 * block_size
        return block

    if len(prompt) < block_size:
        raise ValueError("the reference encodes at least one whole prompt block first")
    # the previous step's decoded positions: a block's first token read at the commit
    decoded_last = {"positions": [False] * block_size}

    def first_token_read() -> None:
        decoded_last["positions"] = [True] + [False] * (block_size - 1)

    return generate_by_shifted_blocks(
        model, prompt, block_size, mask_id, max_tokens,
        lambda block, past: denoise(block, past, decoded_last["positions"]),
        on_first_token=first_token_read)
