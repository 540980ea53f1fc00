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
