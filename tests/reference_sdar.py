"""Plain-PyTorch reference of SDAR (Qwen3 / Qwen3-MoE) and of its block-diffusion decoding.

This is the ground truth that the plugin is compared against, so it favours obviousness
over speed: no KV cache, every denoising step re-runs the whole sequence with an explicit
block-causal mask, and everything is computed in float32.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

STRATEGIES = ("low_confidence_dynamic", "low_confidence_static", "sequential", "threshold")


def block_causal_mask(length: int, block_size: int) -> torch.Tensor:
    """[length, length] bool: query i may attend key j iff j // block_size <= i // block_size."""
    block_index = torch.arange(length) // block_size
    return block_index[None, :] <= block_index[:, None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class ReferenceSDAR:
    """SDAR / SDAR-MoE forward pass from a checkpoint directory (config.json + model.safetensors)."""

    def __init__(self, checkpoint_dir: str | pathlib.Path):
        checkpoint_dir = pathlib.Path(checkpoint_dir)
        self.config = json.loads((checkpoint_dir / "config.json").read_text())
        weights = load_file(str(checkpoint_dir / "model.safetensors"))
        self.weights = {name: tensor.float() for name, tensor in weights.items()}
        cfg = self.config
        self.num_layers = cfg["num_hidden_layers"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.num_heads
        self.eps = cfg["rms_norm_eps"]
        self.rope_theta = cfg["rope_theta"] if "rope_theta" in cfg else cfg["rope_parameters"]["rope_theta"]
        self.num_experts_per_tok = cfg.get("num_experts_per_tok")
        self.norm_topk_prob = cfg.get("norm_topk_prob", False)

    # Set to [] to capture every layer's q and k of the next forward (tests of importance).
    captured_qk: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """NeoX (rotate-half) RoPE over the full head_dim. x: [heads, L, head_dim]."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        inv_freq = 1.0 / (self.rope_theta**exponents)  # [head_dim / 2]
        angles = positions.float()[:, None] * inv_freq[None, :]  # [L, head_dim / 2]
        angles = torch.cat((angles, angles), dim=-1)  # [L, head_dim]
        return x * angles.cos() + rotate_half(x) * angles.sin()

    def _attention(self, x: torch.Tensor, mask: torch.Tensor, prefix: str) -> torch.Tensor:
        w = self.weights
        length = x.shape[0]
        positions = torch.arange(length)
        q = (x @ w[f"{prefix}.q_proj.weight"].T).view(length, self.num_heads, self.head_dim)
        k = (x @ w[f"{prefix}.k_proj.weight"].T).view(length, self.num_kv_heads, self.head_dim)
        v = (x @ w[f"{prefix}.v_proj.weight"].T).view(length, self.num_kv_heads, self.head_dim)
        q = rms_norm(q, w[f"{prefix}.q_norm.weight"], self.eps).transpose(0, 1)  # [H, L, D]
        k = rms_norm(k, w[f"{prefix}.k_norm.weight"], self.eps).transpose(0, 1)  # [Hkv, L, D]
        v = v.transpose(0, 1)  # [Hkv, L, D]
        q = self._rope(q, positions)
        k = self._rope(k, positions)
        if self.captured_qk is not None:  # q, k after norm and RoPE, [L, heads, D]
            self.captured_qk.append((q.transpose(0, 1).clone(), k.transpose(0, 1).clone()))
        # GQA: query head h reads kv head h // (H / Hkv).
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=0)  # [H, L, D]
        v = v.repeat_interleave(group, dim=0)  # [H, L, D]
        scores = (q @ k.transpose(1, 2)) / math.sqrt(self.head_dim)  # [H, L, L]
        scores = scores.masked_fill(~mask[None], float("-inf"))
        out = scores.softmax(dim=-1) @ v  # [H, L, D]
        out = out.transpose(0, 1).reshape(length, self.num_heads * self.head_dim)
        return out @ w[f"{prefix}.o_proj.weight"].T

    def _swiglu(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        w = self.weights
        gate = x @ w[f"{prefix}.gate_proj.weight"].T
        up = x @ w[f"{prefix}.up_proj.weight"].T
        return (F.silu(gate) * up) @ w[f"{prefix}.down_proj.weight"].T

    def _mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        """Dense SwiGLU, or a Qwen3-MoE block when the layer has a router (`mlp.gate`)."""
        w = self.weights
        if f"{prefix}.gate.weight" not in w:
            return self._swiglu(x, prefix)
        router_probs = (x @ w[f"{prefix}.gate.weight"].T).float().softmax(dim=-1)  # [L, E]
        top_probs, top_experts = router_probs.topk(self.num_experts_per_tok, dim=-1)  # [L, k]
        if self.norm_topk_prob:
            top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
        # Dense routing weights, zero for experts a token does not use.
        routing = torch.zeros_like(router_probs).scatter(1, top_experts, top_probs)  # [L, E]
        out = torch.zeros_like(x)
        for e in range(router_probs.shape[1]):
            out = out + routing[:, e : e + 1] * self._swiglu(x, f"{prefix}.experts.{e}")  # [L, hidden]
        return out

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """token_ids: [L] long (absolute positions 0..L-1); mask: [L, L] bool (True = may attend).

        Returns the logits, [L, vocab] float32.
        """
        w = self.weights
        h = w["model.embed_tokens.weight"][token_ids]  # [L, hidden]
        for i in range(self.num_layers):
            prefix = f"model.layers.{i}"
            attn_in = rms_norm(h, w[f"{prefix}.input_layernorm.weight"], self.eps)
            h = h + self._attention(attn_in, mask, f"{prefix}.self_attn")
            mlp_in = rms_norm(h, w[f"{prefix}.post_attention_layernorm.weight"], self.eps)
            h = h + self._mlp(mlp_in, f"{prefix}.mlp")
        return rms_norm(h, w["model.norm.weight"], self.eps) @ w["lm_head.weight"].T

    __call__ = forward


@dataclasses.dataclass
class GenerationTrace:
    output_ids: list[int]
    steps_per_block: list[int]  # denoising forwards run for each block, in order
    step_map: list[int]  # per output token: the denoising forward (0-based) that unmasked it
    # per output token: log-softmax of the model's raw logits (mask token included) at the
    # forward that unmasked it, and the 2 most likely tokens there (the plugin's definition
    # of a diffusion token's logprob; the published loop returns none)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top2: list[list[int]] = dataclasses.field(default_factory=list)


def transfer_quotas(block_size: int, steps: int) -> list[int]:
    """Tokens to commit at each step: block_size spread evenly, earlier steps take the remainder."""
    return [block_size // steps + (1 if s < block_size % steps else 0) for s in range(steps)]


def select_positions(
    strategy: str,
    confidence: torch.Tensor,
    masked: torch.Tensor,
    quota: int,
    threshold: float,
    last_step: bool,
) -> torch.Tensor:
    """Which block positions to commit. confidence: [B] (-inf where not masked); masked: [B] bool.

    Returns a [B] bool tensor.
    """
    num_masked = int(masked.sum())
    order = torch.sort(confidence, descending=True, stable=True).indices  # ties: lower position first

    def top(k: int) -> torch.Tensor:
        chosen = torch.zeros_like(masked)
        chosen[order[:k]] = True
        return chosen

    if strategy == "low_confidence_dynamic":
        confident = masked & (confidence > threshold)
        return confident if int(confident.sum()) >= quota else top(min(quota, num_masked))
    if strategy == "low_confidence_static":
        return top(min(quota, num_masked))
    if strategy == "sequential":
        chosen = torch.zeros_like(masked)
        chosen[masked.nonzero().flatten()[: min(quota, num_masked)]] = True
        return chosen
    if strategy == "threshold":
        if last_step:
            return masked.clone()
        return top(1) | (masked & (confidence >= threshold))
    raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")


def reference_generate_trace(
    model: ReferenceSDAR,
    prompt_ids: list[int],
    *,
    block_size: int,
    mask_id: int,
    max_tokens: int,
    strategy: str = "low_confidence_dynamic",
    threshold: float = 0.9,
    denoising_steps: int | None = None,
    stop_token_ids: set[int] | frozenset[int] = frozenset(),
) -> GenerationTrace:
    """Greedy block-diffusion decoding; see `reference_generate`."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    steps = denoising_steps or block_size
    quotas = transfer_quotas(block_size, steps)
    prompt_len = len(prompt_ids)
    # Blocks sit on the absolute grid: the first one holds the prompt tail, then masks.
    block_start = (prompt_len // block_size) * block_size
    committed = list(prompt_ids[:block_start])
    block = torch.tensor(prompt_ids[block_start:] + [mask_id] * (block_size - prompt_len % block_size))

    output: list[int] = []
    steps_per_block: list[int] = []
    step_map: list[int] = []
    logprobs: list[float] = []
    top2: list[list[int]] = []
    forwards = 0
    while len(output) < max_tokens:
        num_steps = 0
        decoded_at = torch.full((block_size,), -1)
        logprob_at = torch.zeros(block_size)
        top2_at = torch.zeros(block_size, 2, dtype=torch.long)
        for s in range(steps):
            masked = block == mask_id  # [B]
            if not masked.any():
                break
            tokens = torch.cat((torch.tensor(committed, dtype=torch.long), block))
            logits = model.forward(tokens, block_causal_mask(len(tokens), block_size))[-block_size:]  # [B, V]
            raw = logits.float().log_softmax(dim=-1)
            logits[:, mask_id] = float("-inf")
            probs = logits.float().softmax(dim=-1)
            x0 = probs.argmax(dim=-1)  # [B]
            confidence = probs.gather(1, x0[:, None]).squeeze(1)
            confidence = torch.where(masked, confidence, torch.full_like(confidence, float("-inf")))
            last_step = s == steps - 1
            chosen = select_positions(strategy, confidence, masked, quotas[s], threshold, last_step)
            block = torch.where(chosen, x0, block)
            decoded_at[chosen] = forwards
            logprob_at[chosen] = raw.gather(1, x0[:, None]).squeeze(1)[chosen]
            top2_at[chosen] = raw.topk(2, dim=-1).indices[chosen]
            forwards += 1
            num_steps += 1
        if (block == mask_id).any():
            raise RuntimeError(f"block still has masks after {steps} steps ({strategy=})")
        steps_per_block.append(num_steps)

        finished = False
        for position, token in enumerate(block.tolist(), start=block_start):
            if position < prompt_len:
                continue
            output.append(token)
            step_map.append(int(decoded_at[position - block_start]))
            logprobs.append(float(logprob_at[position - block_start]))
            top2.append(top2_at[position - block_start].tolist())
            if token in stop_token_ids or len(output) == max_tokens:
                finished = True
                break
        if finished:
            break
        committed.extend(block.tolist())
        block_start += block_size
        block = torch.full((block_size,), mask_id)
    return GenerationTrace(output_ids=output, steps_per_block=steps_per_block, step_map=step_map,
                           logprobs=logprobs, top2=top2)


def reference_generate(
    model: ReferenceSDAR,
    prompt_ids: list[int],
    *,
    block_size: int,
    mask_id: int,
    max_tokens: int,
    strategy: str = "low_confidence_dynamic",
    threshold: float = 0.9,
    denoising_steps: int | None = None,
    stop_token_ids: set[int] | frozenset[int] = frozenset(),
) -> list[int]:
    """Greedy SDAR block-diffusion decoding of `prompt_ids`; returns the generated token ids.

    Each block is denoised in at most `denoising_steps` (default `block_size`) forwards of the
    whole sequence with `block_causal_mask`. At every step the mask token is banned, each
    position proposes its argmax with confidence = its softmax probability, and `strategy`
    decides which masked positions commit (see `select_positions`). A finished block is
    emitted token by token; a stop token is emitted and ends generation, as does reaching
    `max_tokens`.
    """
    return reference_generate_trace(
        model,
        prompt_ids,
        block_size=block_size,
        mask_id=mask_id,
        max_tokens=max_tokens,
        strategy=strategy,
        threshold=threshold,
        denoising_steps=denoising_steps,
        stop_token_ids=stop_token_ids,
    ).output_ids
