"""Plain-PyTorch reference of Dream: the published forward and ``diffusion_generate`` loop.

Written from the authors' code, independently of the package (only torch, safetensors and
json). Dream's model code lives in its Hugging Face repositories (Dream-org/Dream-v0-*-7B:
``modeling_dream.py``, ``generation_utils.py``); the copies read here are NVlabs/Fast-dLLM's
``dream/model/`` at commit 24cc59e, whose additions (prefix / dual caches, the
``confidence_threshold`` algorithm) are not reproduced. Float32, one sequence, no cache.

Forward (``DreamModel``): Qwen2 without the causal mask: ``x = embed_tokens[ids]``; per layer
``x += o_proj(attn(input_layernorm(x)))``, ``x += down(silu(gate(h)) * up(h))``, ``h =
post_attention_layernorm(x)``; RMSNorm (float32, ``rms_norm_eps``, times the weight); q/k/v
with biases, ``o_proj`` without; rotate-half RoPE (``rope_theta``, no scaling) at positions
0..L-1; grouped-query attention; softmax attention with no mask (the published
``attention_mask="full"``: no padding); ``norm``; ``lm_head`` (the embedding where
``tie_word_embeddings``). ``forward`` returns each row's logits as computed, unshifted.

Decoding (``reference_generate``: ``diffusion_generate`` at temperature 0, no top-p/top-k,
``alg_temp`` None, no padding): the prompt and ``max_new_tokens`` masks; ``timesteps =
linspace(1, eps, steps + 1)`` (float32); per step i one forward of the whole canvas, the
logits shifted (``cat([logits[:, :1], logits[:, :-1]])``: position j reads row j - 1, the
first position its own row), at the masked positions the softmax's maximum and its token
(``probs.max``), the confidence by ``alg`` (``maskgit_plus``: that maximum; ``topk_margin``:
the top-1 minus the top-2 probability; ``entropy``: ``sum(p * log(p + 1e-10))``, the negative
entropy); ``int(M * (1 - s / t))`` masks transferred (M the masked count as a float32
tensor, ``s = t_{i+1}``, ``t = t_i``; every remaining mask at the last step), the highest
confidences by ``torch.topk`` over the canvas (-inf at unmasked positions). ``origin``
draws random numbers even at temperature 0 and is not reproduced.
"""

from __future__ import annotations

import json
import math
import pathlib

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

ALGORITHMS = ("maskgit_plus", "topk_margin", "entropy")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class ReferenceDream:
    """The published forward from a checkpoint directory (config.json + model.safetensors)."""

    def __init__(self, checkpoint_dir: str | pathlib.Path):
        checkpoint_dir = pathlib.Path(checkpoint_dir)
        self.config = cfg = json.loads((checkpoint_dir / "config.json").read_text())
        self.weights = {name: tensor.float() for name, tensor in
                        load_file(str(checkpoint_dir / "model.safetensors")).items()}
        if cfg.get("rope_scaling"):
            raise ValueError("the reference computes RoPE without scaling")
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.num_heads
        self.eps = cfg["rms_norm_eps"]

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.weights[name + ".weight"], self.weights.get(name + ".bias"))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x: [heads, L, head_dim] at ``positions`` [L] (default 0..L-1)."""
        dim = self.head_dim
        inv_freq = 1.0 / (self.config["rope_theta"] ** (
            torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # [dim / 2]
        if positions is None:
            positions = torch.arange(x.shape[1])
        angles = positions.float()[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)  # [L, dim]
        return x * angles.cos() + rotate_half(x) * angles.sin()

    def _attention(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        length = x.shape[0]
        q = self._linear(x, prefix + "q_proj").view(length, self.num_heads, self.head_dim)
        k = self._linear(x, prefix + "k_proj").view(length, self.num_kv_heads, self.head_dim)
        v = self._linear(x, prefix + "v_proj").view(length, self.num_kv_heads, self.head_dim)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, L, D]
        q, k = self._rope(q), self._rope(k)
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=0)  # [H, L, D]
        v = v.repeat_interleave(group, dim=0)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(self.head_dim)  # [H, L, L], no mask
        out = (scores.softmax(dim=-1) @ v).transpose(0, 1).reshape(length, -1)  # [L, H * D]
        return self._linear(out, prefix + "o_proj")

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids: [L] long. Returns each row's logits [L, vocab], float32, unshifted."""
        w, cfg = self.weights, self.config
        x = w["model.embed_tokens.weight"][token_ids]  # [L, hidden]
        for i in range(cfg["num_hidden_layers"]):
            layer = f"model.layers.{i}."
            x = x + self._attention(rms_norm(x, w[layer + "input_layernorm.weight"], self.eps),
                                    layer + "self_attn.")
            x = self._feed_forward(x, layer)
        return self._logits(x)

    def new_cache(self, length: int) -> list[list[torch.Tensor]]:
        """Per layer [K, V], zeros [kv_heads, length, head_dim] (after RoPE): filled by a
        forward of every position before any other reads it."""
        return [[torch.zeros(self.num_kv_heads, length, self.head_dim) for _ in range(2)]
                for _ in range(self.config["num_hidden_layers"])]

    def _cached_attention(self, x: torch.Tensor, prefix: str, positions: torch.Tensor,
                          cache: list[torch.Tensor]) -> torch.Tensor:
        """Rows ``x`` [n, hidden] at ``positions`` [n]: their keys/values (after RoPE)
        replace the cache's at those positions, and they attend to the whole cache (no
        mask), as Fast-dLLM's Dream cache forwards do."""
        n = x.shape[0]
        q = self._linear(x, prefix + "q_proj").view(n, self.num_heads, self.head_dim)
        k = self._linear(x, prefix + "k_proj").view(n, self.num_kv_heads, self.head_dim)
        v = self._linear(x, prefix + "v_proj").view(n, self.num_kv_heads, self.head_dim)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, n, D]
        q, k = self._rope(q, positions), self._rope(k, positions)
        cache[0][:, positions] = k
        cache[1][:, positions] = v
        group = self.num_heads // self.num_kv_heads
        keys = cache[0].repeat_interleave(group, dim=0)  # [H, L, D]
        values = cache[1].repeat_interleave(group, dim=0)
        scores = (q @ keys.transpose(1, 2)) / math.sqrt(self.head_dim)  # [H, n, L]
        out = (scores.softmax(dim=-1) @ values).transpose(0, 1).reshape(n, -1)
        return self._linear(out, prefix + "o_proj")

    @torch.no_grad()
    def forward_rows(self, token_ids: torch.Tensor, positions: torch.Tensor,
                     cache: list[list[torch.Tensor]]) -> torch.Tensor:
        """The rows ``token_ids`` [n] at ``positions`` [n] against ``cache``
        (``new_cache``; their K/V written into it). Returns their logits [n, vocab],
        unshifted."""
        w, cfg = self.weights, self.config
        x = w["model.embed_tokens.weight"][token_ids]
        for i in range(cfg["num_hidden_layers"]):
            layer = f"model.layers.{i}."
            x = x + self._cached_attention(
                rms_norm(x, w[layer + "input_layernorm.weight"], self.eps),
                layer + "self_attn.", positions, cache[i])
            x = self._feed_forward(x, layer)
        return self._logits(x)

    def _feed_forward(self, x: torch.Tensor, layer: str) -> torch.Tensor:
        """The layer's second residual half: ``x + mlp(post_attention_layernorm(x))``."""
        h = rms_norm(x, self.weights[layer + "post_attention_layernorm.weight"], self.eps)
        return x + self._linear(F.silu(self._linear(h, layer + "mlp.gate_proj"))
                                * self._linear(h, layer + "mlp.up_proj"),
                                layer + "mlp.down_proj")

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head (the embedding where tied): [L, vocab]."""
        x = rms_norm(x, self.weights["model.norm.weight"], self.eps)
        head = self.weights["model.embed_tokens.weight"
                            if self.config.get("tie_word_embeddings") else "lm_head.weight"]
        return x @ head.T

    __call__ = forward


def confidences(probs: torch.Tensor, alg: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(confidence [M], token [M]) of the masked rows' probabilities [M, V], greedy, as the
    published ``sample_tokens`` computes them."""
    confidence, x0 = probs.max(dim=-1)
    if alg == "topk_margin":
        ranked = torch.sort(probs, dim=-1, descending=True).values
        confidence = ranked[:, 0] - ranked[:, 1]
    elif alg == "entropy":
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    elif alg != "maskgit_plus":
        raise ValueError(f"unknown alg {alg!r}; expected one of {ALGORITHMS}")
    return confidence, x0


def transfer_count(masked: int, step: int, timesteps: torch.Tensor) -> int:
    """Masks transferred at ``step``: ``int(M * (1 - s / t))`` in float32 before the last
    step (``timesteps`` has steps + 1 entries), every one at the last."""
    steps = len(timesteps) - 1
    count = torch.tensor(masked) / 1  # float32, as the published ``sum() / batch``
    if step == steps - 1:
        return int(count)
    t, s = timesteps[step], timesteps[step + 1]
    return int(count * (1 - s / t))


@torch.no_grad()
def reference_generate(model: ReferenceDream, prompt_ids: list[int], *, mask_id: int,
                       max_new_tokens: int, steps: int, eps: float = 1e-3,
                       alg: str = "maskgit_plus") -> list[int]:
    """Dream's ``diffusion_generate`` at temperature 0, one prompt; returns the
    ``max_new_tokens`` generated ids (the canvas after the prompt)."""
    start = len(prompt_ids)
    x = torch.full((1, start + max_new_tokens), mask_id, dtype=torch.long)  # [1, L]
    x[0, :start] = torch.tensor(prompt_ids, dtype=torch.long)
    timesteps = torch.linspace(1, eps, steps + 1)
    for step in range(steps):
        masked = x == mask_id  # [1, L]
        logits = model(x[0])[None]  # [1, L, V]
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)  # row j - 1 for j
        confidence, x0 = confidences(logits[masked].softmax(dim=-1), alg)  # [M]
        count = transfer_count(int(masked.sum()), step, timesteps)
        full_confidence = torch.full_like(x, -torch.inf, dtype=logits.dtype)  # [1, L]
        full_confidence[masked] = confidence
        if count > 0:
            _, chosen = torch.topk(full_confidence, count)  # [1, count]
            proposals = torch.full_like(x, mask_id)
            proposals[masked] = x0
            x[0, chosen[0]] = proposals[0, chosen[0]]
    return x[0, start:].tolist()


@torch.no_grad()
def reference_generate_cached(model: ReferenceDream, prompt_ids: list[int], *, mask_id: int,
                              cache: str, max_new_tokens: int, block_length: int, steps: int,
                              eps: float = 1e-3, threshold: float | None = None) -> list[int]:
    """Fast-dLLM's Dream block loop (NVlabs/Fast-dLLM ``dream/model/
    generation_utils_block.py`` at 24cc59e, ``_sample``) at temperature 0, one prompt, with
    ``dual_cache`` (``cache="dual"``) or without it (``"prefix"``): per block of
    ``block_length`` after the prompt, a forward of the whole sequence rewrites every
    position's KV, and its shifted logits' argmax at the block's first position is
    committed unconditionally; then, until the block has no mask, a forward of the block
    (dual) or the block and every later position (prefix) against the KV the others keep,
    the logits shifted within that window (position j reads row j - 1; the window's first
    position, decided, its own), decides: with ``threshold`` (the published
    ``confidence_threshold`` alg) the most confident masked position of the block and every
    other at or above it; otherwise the block's timestep schedule (``linspace(1, eps,
    steps_per_block + 1)``, the step after the refresh being step 1, ``int(M * (1 - s /
    t))`` of the block's M masks, all at step ``steps_per_block - 1``) ranked by negative
    entropy, as the published loop ranks for every alg other than ``confidence_threshold``.
    ``steps`` is the published total (``steps_per_block = steps // num_blocks``). The
    published loop stops a block at step ``steps_per_block`` whatever it holds, which
    leaves masks only with one step per block; this reference requires at least two."""
    if cache not in ("prefix", "dual"):
        raise ValueError(f"cache must be 'prefix' or 'dual', got {cache!r}")
    num_blocks = max_new_tokens // block_length
    if max_new_tokens % block_length or steps % num_blocks or steps // num_blocks < 2:
        raise ValueError("max_new_tokens and steps must split evenly into blocks, with at "
                         "least two steps per block")
    steps_per_block = steps // num_blocks
    timesteps = torch.linspace(1, eps, steps_per_block + 1)
    start = len(prompt_ids)
    x = torch.full((start + max_new_tokens,), mask_id, dtype=torch.long)
    x[:start] = torch.tensor(prompt_ids, dtype=torch.long)
    everything = torch.arange(len(x))
    for block_start in range(start, start + max_new_tokens, block_length):
        block_end = block_start + block_length
        kv = model.new_cache(len(x))
        logits = model.forward_rows(x, everything, kv)
        x[block_start] = logits[block_start - 1].argmax()  # shifted: row j - 1 for j
        window = torch.arange(block_start, len(x) if cache == "prefix" else block_end)
        step = 1
        while bool((x[block_start:block_end] == mask_id).any()):
            logits = model.forward_rows(x[window], window, kv)
            logits = torch.cat([logits[:1], logits[:-1]])  # [window, V]
            masked = (x[window] == mask_id) & (window < block_end)
            probs = logits[masked].softmax(dim=-1)
            top, x0 = probs.max(dim=-1)
            if threshold is not None:
                confidence = top
                count = int(masked.sum())
            else:
                confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
                count = transfer_count(int(masked.sum()), step, timesteps)
            full = torch.full((len(window),), -torch.inf)
            full[masked] = confidence
            proposals = torch.full((len(window),), mask_id, dtype=torch.long)
            proposals[masked] = x0
            if count > 0:
                chosen_confidence, chosen = torch.topk(full, count)
                if threshold is not None:
                    keep = [0] + [k for k in range(1, count)
                                  if float(chosen_confidence[k]) >= threshold]
                    chosen = chosen[keep]
                x[window[chosen]] = proposals[chosen]
            step += 1
    return x[start:].tolist()
