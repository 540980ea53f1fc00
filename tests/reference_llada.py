"""Plain-PyTorch reference of LLaDA 1.x: the published forward and ``generate.py`` loop.

Written from the authors' code, independently of the package (only torch, safetensors and
json): the forward from ``modeling_llada.py`` (ML-GSAI/LLaDA at commit 5975047, the model's
remote code; ``block_type: llama``), the decoding loop from ``generate.py`` (ML-GSAI/LLaDA
at commit b7e6c35). Everything runs in float32, one sequence, no cache.

Forward (``LLaDALlamaBlock``): ``x = wte[ids]``; per block ``x += attn_out(attn(attn_norm(x)))``
and ``x += ff_out(silu(ff_proj(h)) * up_proj(h))``, ``h = ff_norm(x)``; RMSNorm (mean of
squares in float32, ``rms_norm_eps``, times the weight); q/k/v projections (biases where the
checkpoint has them: ``include_bias`` / ``include_qkv_bias``), heads of ``d_model / n_heads``,
RoPE in float32 with rotate-half over the whole head (``rope_theta``, positions 0..L-1),
key/value heads repeated for grouped-query attention, softmax attention with no mask at all
(every position attends to every other); ``ln_f``; the output layer ``ff_out``, or the
embedding where ``weight_tying``; ``scale_logits`` multiplies by ``1/sqrt(d_model)``.

Decoding (``generate``, temperature 0, ``remasking="low_confidence"``, no CFG, no padding):
``gen_length`` masks after the prompt, semi-autoregressive blocks of ``block_length`` from
the prompt end, ``steps // num_blocks`` steps per block; per block the quotas
``get_num_transfer_tokens`` (its masks ``n`` over ``s`` steps: ``n // s`` each, the first
``n % s`` steps one more); per step one forward of the whole canvas, the argmax token and its
softmax probability at every masked position before the block's end (-inf elsewhere), the
quota's highest by ``torch.topk`` (its tie order) committed; a step whose quota is 0 runs its
forward and commits nothing. ``logits_eos_inf`` / ``confidence_eos_eot_inf`` are the
published switches; the published code hard-codes LLaDA-8B's ids (EOS 126081, EoT 126348),
taken here as arguments. At temperature 0 the published ``logits_with_noise`` is the logits
tensor itself, so its chained assignment sets both ids to -inf in the logits whose softmax
gives the confidence (after the argmax). The published ``random`` remasking, temperature and
CFG are not reproduced.
"""

from __future__ import annotations

import json
import math
import pathlib

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

PREFIX = "model.transformer."


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class ReferenceLLaDA:
    """The published forward from a checkpoint directory (config.json + model.safetensors)."""

    def __init__(self, checkpoint_dir: str | pathlib.Path):
        checkpoint_dir = pathlib.Path(checkpoint_dir)
        self.config = cfg = json.loads((checkpoint_dir / "config.json").read_text())
        self.weights = {name: tensor.float() for name, tensor in
                        load_file(str(checkpoint_dir / "model.safetensors")).items()}
        if cfg.get("block_type") != "llama" or not cfg.get("rope") or cfg.get("alibi"):
            raise ValueError("the reference computes block_type llama with RoPE")
        self.num_heads = cfg["n_heads"]
        if cfg.get("n_kv_heads") is not None:
            self.num_kv_heads = cfg["n_kv_heads"]
        else:
            self.num_kv_heads = 1 if cfg.get("multi_query_attention") else self.num_heads
        self.head_dim = cfg["d_model"] // self.num_heads
        self.eps = cfg["rms_norm_eps"]

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        bias = self.weights.get(name + ".bias")
        return F.linear(x, self.weights[name + ".weight"], bias)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [heads, n, head_dim] at ``positions`` [n]."""
        dim = self.head_dim
        inv_freq = 1.0 / (self.config["rope_theta"] ** (
            torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # [dim / 2]
        angles = positions.float()[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)  # [n, dim]
        return x * angles.cos() + rotate_half(x) * angles.sin()

    def _attention(self, x: torch.Tensor, block: str, positions: torch.Tensor,
                   layer_cache: list[torch.Tensor] | None) -> torch.Tensor:
        """x: [n, d] at ``positions``. ``layer_cache``: this layer's [K, V] ([kv_heads,
        L, D] each, after RoPE) for every position of the sequence, whose rows at
        ``positions`` are replaced by this forward's (Fast-dLLM's ``replace_position``);
        the queries attend to all of them. None: the rows are the whole sequence."""
        length = x.shape[0]
        q = self._linear(x, block + "q_proj").view(length, self.num_heads, self.head_dim)
        k = self._linear(x, block + "k_proj").view(length, self.num_kv_heads, self.head_dim)
        v = self._linear(x, block + "v_proj").view(length, self.num_kv_heads, self.head_dim)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, n, D]
        q, k = self._rope(q, positions), self._rope(k, positions)
        if layer_cache is not None:
            layer_cache[0][:, positions], layer_cache[1][:, positions] = k, v
            k, v = layer_cache
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=0)  # [H, L, D]
        v = v.repeat_interleave(group, dim=0)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(self.head_dim)  # [H, n, L], no mask
        out = (scores.softmax(dim=-1) @ v).transpose(0, 1).reshape(length, -1)  # [n, d]
        return self._linear(out, block + "attn_out")

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids: [L] long. Returns the logits [L, embedding rows], float32."""
        return self.forward_rows(token_ids, torch.arange(len(token_ids)), None)

    @torch.no_grad()
    def new_cache(self, length: int) -> list[list[torch.Tensor]]:
        """Per layer [K, V], zeros [kv_heads, length, head_dim]: filled by a forward of
        every position (the refresh) before any other reads it."""
        return [[torch.zeros(self.num_kv_heads, length, self.head_dim) for _ in range(2)]
                for _ in range(self.config["n_layers"])]

    @torch.no_grad()
    def forward_rows(self, token_ids: torch.Tensor, positions: torch.Tensor,
                     cache: list[list[torch.Tensor]] | None) -> torch.Tensor:
        """The rows ``token_ids`` [n] at ``positions`` [n] against ``cache`` (``new_cache``;
        their K/V written into it) or, without one, as the whole sequence. Returns their
        logits [n, embedding rows]."""
        w, cfg = self.weights, self.config
        x = w[PREFIX + "wte.weight"][token_ids]  # [n, d]
        for i in range(cfg["n_layers"]):
            block = f"{PREFIX}blocks.{i}."
            x = x + self._attention(rms_norm(x, w[block + "attn_norm.weight"], self.eps),
                                    block, positions, None if cache is None else cache[i])
            h = rms_norm(x, w[block + "ff_norm.weight"], self.eps)
            x = x + self._linear(F.silu(self._linear(h, block + "ff_proj"))
                                 * self._linear(h, block + "up_proj"), block + "ff_out")
        x = rms_norm(x, w[PREFIX + "ln_f.weight"], self.eps)
        if cfg.get("weight_tying"):
            logits = x @ w[PREFIX + "wte.weight"].T
        else:
            logits = self._linear(x, PREFIX + "ff_out")
        if cfg.get("scale_logits"):
            logits = logits * (1 / math.sqrt(cfg["d_model"]))
        return logits

    __call__ = forward


def get_num_transfer_tokens(masked: int, steps: int) -> list[int]:
    """The published quota schedule: ``masked // steps`` per step, the first
    ``masked % steps`` steps one more."""
    return [masked // steps + (1 if i < masked % steps else 0) for i in range(steps)]


@torch.no_grad()
def reference_generate(model: ReferenceLLaDA, prompt_ids: list[int], *, mask_id: int,
                       gen_length: int = 128, block_length: int = 128, steps: int = 128,
                       logits_eos_inf: bool = False, confidence_eos_eot_inf: bool = False,
                       eos_id: int = 126081, eot_id: int = 126348) -> list[int]:
    """LLaDA's ``generate.py`` at temperature 0 with ``low_confidence`` remasking, one
    prompt; returns the ``gen_length`` generated ids (the canvas after the prompt, masks
    included where a schedule leaves any)."""
    if gen_length % block_length:
        raise ValueError("gen_length must be a multiple of block_length")
    num_blocks = gen_length // block_length
    if steps % num_blocks:
        raise ValueError("steps must be a multiple of the number of blocks")
    steps_per_block = steps // num_blocks
    start = len(prompt_ids)
    x = torch.full((start + gen_length,), mask_id, dtype=torch.long)
    x[:start] = torch.tensor(prompt_ids, dtype=torch.long)
    for block in range(num_blocks):
        block_end = start + (block + 1) * block_length
        block_masks = int((x[block_end - block_length:block_end] == mask_id).sum())
        for quota in get_num_transfer_tokens(block_masks, steps_per_block):
            masked = x == mask_id  # [L]
            logits = model(x)  # [L, V]
            if logits_eos_inf:
                logits[:, eos_id] = -torch.inf
            x0 = logits.argmax(dim=-1)  # [L]
            if confidence_eos_eot_inf:
                logits[:, eos_id] = -torch.inf
                logits[:, eot_id] = -torch.inf
            probability = logits.softmax(dim=-1).gather(-1, x0[:, None])[:, 0]  # [L]
            probability[block_end:] = -torch.inf
            x0 = torch.where(masked, x0, x)
            confidence = torch.where(masked, probability, -torch.inf)
            chosen = torch.topk(confidence, k=quota).indices
            x[chosen] = x0[chosen]
    return x[start:].tolist()


def fast_dllm_transfer(confidence: torch.Tensor, quota: int, threshold: float | None,
                       factor: float | None) -> torch.Tensor:
    """Indices Fast-dLLM's ``get_transfer_index`` / ``get_transfer_index_dynamic``
    (f6b35ec) commit, from ``confidence`` [n] (-inf where not a candidate): the top
    ``quota``; with ``threshold``, the top one and every other candidate at or above it;
    with ``factor``, the ranks before the first rank n (1-based, n >= 2) below
    1 - factor / (n + 1), all of them where that rank is the last or there is none."""
    candidates = int(torch.isfinite(confidence).sum())
    if factor is not None:
        ranked = torch.sort(confidence, descending=True).values[:candidates].tolist()
        count = candidates
        for index in range(1, candidates):
            if ranked[index] < 1 - factor / (index + 2):
                count = candidates if index == candidates - 1 else index
                break
        return torch.topk(confidence, k=count).indices
    if threshold is None:
        return torch.topk(confidence, k=quota).indices
    top = torch.topk(confidence, k=candidates)
    keep = [0] + [k for k in range(1, candidates) if float(top.values[k]) >= threshold]
    return top.indices[keep]


@torch.no_grad()
def reference_generate_cached(model: ReferenceLLaDA, prompt_ids: list[int], *, mask_id: int,
                              cache: str, gen_length: int = 128, block_length: int = 128,
                              steps: int = 128, threshold: float | None = None,
                              factor: float | None = None) -> list[int]:
    """Fast-dLLM's ``generate_with_prefix_cache`` (``cache="prefix"``) and
    ``generate_with_dual_cache`` (``"dual"``), and its ``generate`` without a cache
    (``"none"``), at temperature 0 with ``low_confidence`` remasking and the quota
    schedule, the ``threshold`` or the ``factor`` rule (``fast_dllm_transfer``), one
    prompt (NVlabs/Fast-dLLM ``llada/generate.py`` at 24cc59e; the rules at f6b35ec;
    without a cache every forward is of the whole sequence): per block, a forward of the whole sequence rewrites
    every position's KV and makes the block's first decision (quota 0); then, until the
    block has no mask, a forward of the block and every later position (prefix) or of the
    block alone (dual), their KV replacing the cached rows, the others read as the
    refresh left them, makes the next decision (quota i). The published loop runs one
    forward more after a refresh that fills the block (it checks for masks after the
    forward) and then indexes past its schedule when a block has one step; this reference
    checks first, which changes no output where the published loop runs."""
    if cache not in ("prefix", "dual", "none"):
        raise ValueError(f"cache must be 'prefix', 'dual' or 'none', got {cache!r}")
    if gen_length % block_length or steps % (gen_length // block_length):
        raise ValueError("gen_length and steps must split evenly into blocks")
    steps_per_block = steps // (gen_length // block_length)
    start = len(prompt_ids)
    x = torch.full((start + gen_length,), mask_id, dtype=torch.long)
    x[:start] = torch.tensor(prompt_ids, dtype=torch.long)
    everything = torch.arange(len(x))
    for block_start in range(start, start + gen_length, block_length):
        block_end = block_start + block_length
        quotas = get_num_transfer_tokens(int((x[block_start:block_end] == mask_id).sum()),
                                         steps_per_block)
        kv = model.new_cache(len(x))
        rows = everything  # the refresh
        for quota in quotas:
            if not (x[block_start:block_end] == mask_id).any():
                break
            logits = model.forward_rows(x[rows], rows, kv)  # [rows, V]
            x0 = logits.argmax(dim=-1)
            # float64, as Fast-dLLM's get_transfer_index
            probability = logits.double().softmax(dim=-1).gather(-1, x0[:, None])[:, 0]
            masked = (x[rows] == mask_id) & (rows < block_end)
            confidence = torch.where(masked, probability, -torch.inf)
            top = fast_dllm_transfer(confidence, quota, threshold, factor)
            x[rows[top]] = x0[top]
            if cache != "none":
                rows = torch.arange(block_start, len(x) if cache == "prefix" else block_end)
    return x[start:].tolist()
