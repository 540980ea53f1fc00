"""Plain-PyTorch references of Sparse-dLLM, ES-dLLM and Ada-DLM on a full-attention LLaDA
model under Fast-dLLM's dual cache, greedy, one prompt, no paging.

Written with plain loops, independently of the package (torch and the other test
references only): the forward is ``reference_llada``'s, run layer by layer so that a
method can act between its parts; each method's rule is the one its block-diffusion
reference encodes (``reference_sparse_prefix.select_kept``, ``reference_early_skip``'s
``es_importance`` / ``es_keep_count`` / ``es_keep`` / ``ada_freeze``), the unmasking
strategies are ``reference_sdar.select_positions``.

The loop is Fast-dLLM's ``generate_with_dual_cache`` (``reference_llada
.reference_generate_cached(cache="dual")``): semi-autoregressive blocks of ``block_length``
after the prompt; per block, step 0 (the refresh) forwards the whole sequence, writing every
position's K/V into a fresh cache, and decides; every later step forwards the block's rows
alone against that cache (their K/V replacing the cached rows) and decides, until the
block has no mask. The proposal at a row is the arg-max of its float32 logits with the
mask token barred, its confidence the softmax probability of that token (float32).

- Sparse-dLLM (the paper's bidirectional eviction: the context is the prefix and the
  suffix). Step ``i`` of a block: ``i < delay_steps`` dense; ``i == delay_steps`` dense,
  and at every layer, once the block's K/V are in the cache, the block's queries (after
  RoPE) score the context positions [0, block start) + [block end, end) (mean query per
  head, dot product with the cached key of its KV head, times 1/sqrt(head_dim), mean over
  the heads, or over each KV head's group with ``per_kv_head``), max-pool of
  ``pool_kernel`` over that list, top floor(``retention_ratio`` * N), ties to the earlier;
  ``i > delay_steps``: the block's rows attend to the kept positions of the layer plus
  the whole block. A new selection per block.
- ES-dLLM (Eq. 1, the authors' safeguards): a step computes every row through every
  layer (and caches the skip layers' outputs of the block's positions) when it is the
  block's refresh, a multiple of ``refresh_period`` or the block's last allowed step;
  other steps drop the less important block rows after each skip layer; a dropped row's
  K/V at later layers stays what the cache holds, it gets no logits and is not committed,
  its cached output and confidence stay.
- Ada-DLM (section 4.2, Algorithm 1): every block row is computed every step; the
  positions the freeze rule picks are committed. ``cache="recompute"`` runs it in LLaDA's
  published loop instead (every step forwards the whole sequence).

Choices none of the papers make, encoded here as the engine makes them:
- Common: the mask token is never proposed and the confidence is float32 (the published
  LLaDA and Fast-dLLM loops keep the mask a candidate; Fast-dLLM's softmax is float64);
  the strategies are the engine's (``threshold``: the most confident mask plus every mask
  at or above the threshold, everything left at the block's last allowed step).
- Sparse-dLLM: the authors' step 1 is a whole-sequence forward whose keys it filters;
  under the dual cache the selection step forwards the block alone, so the context keys
  scored are the refresh's (``delay_steps`` must be at least 1: the refresh has no
  block-only queries); the mean over the heads of each KV head's group (``per_kv_head``)
  is an option of ours (the authors: one list per layer).
- ES-dLLM: the step count and the refresh period are the block's (the authors count steps
  over the generation); the dual refresh is a full step, and it caches the layer outputs
  of the block's positions only (only block rows are ever scored); the keep count is taken
  of the block's rows (the authors' window at a non-prompt step is the block too); the
  keep floor uses this request's decoded count; the block's last allowed step
  (``denoising_steps``) computes everything.
- Ada-DLM: a frozen position commits its proposal at once; K = ceil(capacity * block);
  the history holds the block's steps only (0 before its first); ``static_threshold`` and
  ``confidence_floor`` are ours (None and 0 leave the paper's rule).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from reference_early_skip import ada_freeze, es_importance, es_keep, es_keep_count
from reference_llada import PREFIX, ReferenceLLaDA, rms_norm
from reference_sdar import select_positions, transfer_quotas
from reference_sparse_prefix import select_kept


def output_logits(model: ReferenceLLaDA, x: torch.Tensor) -> torch.Tensor:
    """The published output head of rows ``x`` [n, d]: [n, embedding rows]."""
    w, cfg = model.weights, model.config
    x = rms_norm(x, w[PREFIX + "ln_f.weight"], model.eps)
    if cfg.get("weight_tying"):
        logits = x @ w[PREFIX + "wte.weight"].T
    else:
        logits = model._linear(x, PREFIX + "ff_out")
    if cfg.get("scale_logits"):
        logits = logits * (1 / math.sqrt(cfg["d_model"]))
    return logits


@torch.no_grad()
def forward_by_layer(model: ReferenceLLaDA, token_ids: torch.Tensor, positions: torch.Tensor,
                     cache: list[list[torch.Tensor]], visible_keys=None, after_output=None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``ReferenceLLaDA.forward_rows`` against ``cache``, one layer at a time.

    ``visible_keys(layer, q, keys)``, called once the rows' K/V are in the layer's cache
    (q: [H, n, D] after RoPE, keys: [H_kv, L, D] the layer's cached keys), may return the
    keys each KV head's queries see ([H_kv, L] bool; None: all). ``after_output(layer,
    positions, x)`` (x: [n, d] the layer's output) may return the [n] bool rows that go on.
    Returns the positions that reached the output and their logits [n', V]."""
    w, cfg = model.weights, model.config
    heads, kv_heads, dim = model.num_heads, model.num_kv_heads, model.head_dim
    group = heads // kv_heads
    x = w[PREFIX + "wte.weight"][token_ids]  # [n, d]
    for layer in range(cfg["n_layers"]):
        block = f"{PREFIX}blocks.{layer}."
        n = len(positions)
        h = rms_norm(x, w[block + "attn_norm.weight"], model.eps)
        q = model._linear(h, block + "q_proj").view(n, heads, dim).transpose(0, 1)
        k = model._linear(h, block + "k_proj").view(n, kv_heads, dim).transpose(0, 1)
        v = model._linear(h, block + "v_proj").view(n, kv_heads, dim).transpose(0, 1)
        q, k = model._rope(q, positions), model._rope(k, positions)
        keys, values = cache[layer]  # [H_kv, L, D] each
        keys[:, positions], values[:, positions] = k, v
        visible = None if visible_keys is None else visible_keys(layer, q, keys)
        scores = (q @ keys.repeat_interleave(group, dim=0).transpose(1, 2)) / math.sqrt(dim)
        if visible is not None:
            hidden_keys = ~visible.repeat_interleave(group, dim=0)[:, None, :]  # [H, 1, L]
            scores = scores.masked_fill(hidden_keys, float("-inf"))
        out = scores.softmax(dim=-1) @ values.repeat_interleave(group, dim=0)  # [H, n, D]
        x = x + model._linear(out.transpose(0, 1).reshape(n, -1), block + "attn_out")
        h = rms_norm(x, w[block + "ff_norm.weight"], model.eps)
        x = x + model._linear(F.silu(model._linear(h, block + "ff_proj"))
                              * model._linear(h, block + "up_proj"), block + "ff_out")
        if after_output is not None:
            keep = after_output(layer, positions, x)
            if keep is not None:
                positions, x = positions[keep], x[keep]
    return positions, output_logits(model, x)


def block_proposals(logits: torch.Tensor, positions: torch.Tensor, block_start: int,
                    block_length: int, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[block] confidence (-inf where the block position got no logits) and [block]
    proposal (the mask there) of the rows at ``positions`` that fall in the block."""
    logits = logits.float().clone()
    logits[:, mask_id] = float("-inf")
    probability, token = logits.softmax(dim=-1).max(dim=-1)
    confidence = torch.full((block_length,), float("-inf"))
    proposal = torch.full((block_length,), mask_id, dtype=torch.long)
    for row, position in enumerate(positions.tolist()):
        if block_start <= position < block_start + block_length:
            confidence[position - block_start] = probability[row]
            proposal[position - block_start] = token[row]
    return confidence, proposal


def new_canvas(prompt_ids: list[int], gen_length: int, block_length: int,
               mask_id: int) -> torch.Tensor:
    if gen_length % block_length:
        raise ValueError("gen_length must be a multiple of block_length")
    x = torch.full((len(prompt_ids) + gen_length,), mask_id, dtype=torch.long)
    x[:len(prompt_ids)] = torch.tensor(prompt_ids, dtype=torch.long)
    return x


def record(trace: list[tuple[int, int]] | None, forwarded: int, at_logits: int) -> None:
    """One step into ``trace`` (when given): the rows its forward took in (the whole
    sequence at a refresh, else the block) and the block rows that reached the logits."""
    if trace is not None:
        trace.append((forwarded, at_logits))


def strategy_commits(strategy: str, confidence: torch.Tensor, candidates: torch.Tensor,
                     step: int, steps: int, threshold: float) -> torch.Tensor:
    """[block] bool: the unmasking strategy's commits among ``candidates`` at ``step`` of
    a block allowed ``steps`` (quota: ``transfer_quotas``, the whole block past them)."""
    block_length = len(candidates)
    quota = transfer_quotas(block_length, steps)[step] if step < steps else block_length
    scored = torch.where(candidates, confidence, torch.full_like(confidence, float("-inf")))
    return select_positions(strategy, scored, candidates, quota, threshold,
                            last_step=step >= steps - 1)


@torch.no_grad()
def reference_sparse_dual_generate(model: ReferenceLLaDA, prompt_ids: list[int], *,
                                   mask_id: int, gen_length: int, block_length: int,
                                   strategy: str = "low_confidence_static",
                                   threshold: float = 0.9, denoising_steps: int | None = None,
                                   retention_ratio: float = 0.5, pool_kernel: int = 3,
                                   delay_steps: int = 1, per_kv_head: bool = False,
                                   trace: list[tuple[int, int]] | None = None) -> list[int]:
    """Sparse-dLLM under the dual cache; returns the ``gen_length`` generated ids
    (``trace``: see ``record``)."""
    if delay_steps < 1:
        raise ValueError("under the dual cache the selection step must follow the refresh")
    steps = denoising_steps or block_length
    x = new_canvas(prompt_ids, gen_length, block_length, mask_id)
    length, start = len(x), len(prompt_ids)
    for block_start in range(start, length, block_length):
        block_end = block_start + block_length
        context = list(range(block_start)) + list(range(block_end, length))
        keep = math.floor(retention_ratio * len(context))
        kept: dict[int, list[list[int]]] = {}  # layer -> per KV head, absolute positions
        cache = model.new_cache(length)
        step = 0
        while bool((x[block_start:block_end] == mask_id).any()):
            def visible_keys(layer, q, keys):
                if step < delay_steps:
                    return None
                if step == delay_steps:  # q: the block's queries (a block-only forward)
                    chosen = select_kept(q.transpose(0, 1), keys[:, context].transpose(0, 1),
                                         model.head_dim ** -0.5, keep, pool_kernel,
                                         per_kv_head)
                    kept[layer] = [[context[j] for j in head] for head in chosen]
                    return None
                visible = torch.zeros(model.num_kv_heads, length, dtype=torch.bool)
                visible[:, block_start:block_end] = True
                for head, positions in enumerate(kept[layer]):
                    visible[head, positions] = True
                return visible

            rows = torch.arange(length) if step == 0 else torch.arange(block_start, block_end)
            record(trace, len(rows), block_length)
            rows, logits = forward_by_layer(model, x[rows], rows, cache, visible_keys)
            confidence, proposal = block_proposals(logits, rows, block_start, block_length,
                                                   mask_id)
            masked = x[block_start:block_end] == mask_id
            commit = strategy_commits(strategy, confidence, masked, step, steps, threshold)
            x[block_start:block_end] = torch.where(commit, proposal, x[block_start:block_end])
            step += 1
            assert step <= 4 * block_length
    return x[start:].tolist()


@torch.no_grad()
def reference_es_dual_generate(model: ReferenceLLaDA, prompt_ids: list[int], *, mask_id: int,
                               gen_length: int, block_length: int,
                               skip_layers: tuple[int, ...],
                               strategy: str = "low_confidence_static", threshold: float = 0.9,
                               denoising_steps: int | None = None, alpha: float = 0.5,
                               skip_ratio: float = 0.5, refresh_period: int | None = 4,
                               keep_floor: bool = True, priority_bonuses: bool = True,
                               trace: list[tuple[int, int]] | None = None) -> list[int]:
    """ES-dLLM under the dual cache; returns the ``gen_length`` generated ids
    (``trace``: see ``record``)."""
    steps = denoising_steps or block_length
    x = new_canvas(prompt_ids, gen_length, block_length, mask_id)
    length, start = len(x), len(prompt_ids)
    for block_start in range(start, length, block_length):
        block_end = block_start + block_length
        cache = model.new_cache(length)
        outputs = {layer: [torch.zeros(model.config["d_model"]) for _ in range(block_length)]
                   for layer in skip_layers}  # each position's last output of the layer
        c_prev = [0.0] * block_length
        decoded_last = [False] * block_length
        step = 0
        while bool((x[block_start:block_end] == mask_id).any()):
            masked = (x[block_start:block_end] == mask_id).tolist()
            full = (step == 0 or skip_ratio == 0
                    or (refresh_period is not None and step % refresh_period == 0)
                    or step >= steps - 1)
            bonus = [0.0] * block_length
            bonus[masked.index(True)] += 5.0
            if alpha < 1:
                for p in range(block_length):
                    bonus[p] += 3.0 if decoded_last[p] else 0.0

            def after_output(layer, positions, hidden):
                if layer not in skip_layers:
                    return None
                cached = outputs[layer]
                if full:
                    for position, h in zip(positions.tolist(), hidden):
                        if block_start <= position < block_end:
                            cached[position - block_start] = h.clone()
                    return None
                block = [p - block_start for p in positions.tolist()]  # block rows only
                scores = es_importance(list(hidden), [cached[p] for p in block],
                                       [c_prev[p] for p in block], alpha)
                count = es_keep_count(block_length, skip_layers.index(layer) + 1, skip_ratio,
                                      sum(decoded_last), keep_floor)
                keep = es_keep(scores, [masked[p] for p in block], [c_prev[p] for p in block],
                               count, [bonus[p] for p in block] if priority_bonuses else None,
                               alpha)
                for p, h, kept in zip(block, hidden, keep):
                    if kept:  # only the survivors' outputs are cached
                        cached[p] = h.clone()
                return torch.tensor(keep)

            rows = torch.arange(length) if step == 0 else torch.arange(block_start, block_end)
            forwarded = len(rows)
            rows, logits = forward_by_layer(model, x[rows], rows, cache,
                                            after_output=after_output)
            confidence, proposal = block_proposals(logits, rows, block_start, block_length,
                                                   mask_id)
            computed = confidence > float("-inf")
            record(trace, forwarded, int(computed.sum()))
            candidates = torch.tensor(masked) & computed
            commit = strategy_commits(strategy, confidence, candidates, step, steps, threshold)
            for p in range(block_length):
                if computed[p]:
                    still_masked = masked[p] and not bool(commit[p])
                    c_prev[p] = float(confidence[p]) if still_masked else 0.0
            decoded_last = commit.tolist()
            x[block_start:block_end] = torch.where(commit, proposal, x[block_start:block_end])
            step += 1
            assert step <= 4 * block_length
    return x[start:].tolist()


@torch.no_grad()
def reference_ada_dual_generate(model: ReferenceLLaDA, prompt_ids: list[int], *, mask_id: int,
                                gen_length: int, block_length: int, capacity: float = 0.15,
                                history: int = 3, confidence_floor: float = 0.0,
                                static_threshold: float | None = None,
                                cache: str = "dual",
                                trace: list[tuple[int, int]] | None = None) -> list[int]:
    """Ada-DLM under the dual cache, or with ``cache="recompute"`` in LLaDA's published
    loop (every step forwards the whole sequence); returns the ``gen_length`` generated
    ids (``trace``: see ``record``)."""
    if cache not in ("dual", "recompute"):
        raise ValueError(f"cache must be 'dual' or 'recompute', got {cache!r}")
    x = new_canvas(prompt_ids, gen_length, block_length, mask_id)
    length, start = len(x), len(prompt_ids)
    for block_start in range(start, length, block_length):
        block_end = block_start + block_length
        kv = model.new_cache(length)
        trajectory = [[0.0] * history for _ in range(block_length)]
        step = 0
        while bool((x[block_start:block_end] == mask_id).any()):
            masked = (x[block_start:block_end] == mask_id).tolist()
            whole = step == 0 or cache == "recompute"
            rows = torch.arange(length) if whole else torch.arange(block_start, block_end)
            record(trace, len(rows), block_length)
            rows, logits = forward_by_layer(model, x[rows], rows, kv)
            confidence, proposal = block_proposals(logits, rows, block_start, block_length,
                                                   mask_id)
            for p in range(block_length):
                if masked[p]:
                    trajectory[p] = [float(confidence[p])] + trajectory[p][:-1]
            frozen = ada_freeze(confidence.tolist(), masked, trajectory, capacity,
                                confidence_floor, static_threshold)
            commit = torch.tensor(frozen)
            x[block_start:block_end] = torch.where(commit, proposal, x[block_start:block_end])
            step += 1
            assert step <= block_length
    return x[start:].tolist()
