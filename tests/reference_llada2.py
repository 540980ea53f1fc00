"""Plain-PyTorch reference of the published LLaDA2 MoE forward (``modeling_llada2_moe.py``),
written from its semantics independently of the package: no KV cache, the whole sequence
under a given mask (block-causal aligned to position 0 for generation).

Fused QKV split [q; k; v]; RMSNorm on q and k per head before RoPE; NeoX rotate-half RoPE on
the first int(head_dim * partial_rotary_factor) dims; ``dense`` output projection with its
bias; layers before ``first_k_dense_replace`` dense SwiGLU, the others mixture of experts:
fp32 router logits, sigmoid, ``expert_bias`` for selection only, group score = sum of the
two best biased scores of each group, best ``topk_group`` groups, top-k experts, their
unbiased scores renormalised when k > 1 (eps 1e-20), times ``routed_scaling_factor``, plus
the shared experts. Generation reuses the SDAR reference loop (``reference_sdar``).
"""

from __future__ import annotations

import json
import math
import pathlib

import torch
import torch.nn.functional as F
from reference_sdar import rms_norm, rotate_half
from safetensors.torch import load_file


def reference_route(logits: torch.Tensor, expert_bias: torch.Tensor, top_k: int,
                    n_group: int, topk_group: int, scaling: float):
    """Per token (loops over tokens): (weights [k], experts [k]) from fp32 logits [T, E]."""
    weights, experts = [], []
    for row in logits.float():
        scores = torch.sigmoid(row)
        biased = scores + expert_bias
        size = len(row) // n_group
        group_score = [float(biased[g * size:(g + 1) * size].topk(2).values.sum())
                       for g in range(n_group)]
        best = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        allowed = torch.full_like(biased, float("-inf"))
        for g in best:
            allowed[g * size:(g + 1) * size] = biased[g * size:(g + 1) * size]
        chosen = allowed.topk(top_k).indices
        w = scores[chosen]
        if top_k > 1:
            w = w / (w.sum() + 1e-20)
        weights.append(w * scaling)
        experts.append(chosen)
    return torch.stack(weights), torch.stack(experts)


class ReferenceLLaDA2:
    def __init__(self, checkpoint_dir: str | pathlib.Path):
        checkpoint_dir = pathlib.Path(checkpoint_dir)
        self.config = cfg = json.loads((checkpoint_dir / "config.json").read_text())
        self.weights = {k: v.float() for k, v in
                        load_file(str(checkpoint_dir / "model.safetensors")).items()}
        self.num_layers = cfg["num_hidden_layers"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.num_heads
        self.rotary = int(self.head_dim * cfg.get("partial_rotary_factor", 0.5))
        self.eps = cfg["rms_norm_eps"]

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [heads, L, D]; rotate-half on the first ``rotary`` dims."""
        dims = self.rotary
        inv_freq = 1.0 / (self.config["rope_theta"] ** (
            torch.arange(0, dims, 2, dtype=torch.float32) / dims))
        angles = positions.float()[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)  # [L, dims]
        rotated, passed = x[..., :dims], x[..., dims:]
        rotated = rotated * angles.cos() + rotate_half(rotated) * angles.sin()
        return torch.cat((rotated, passed), dim=-1)

    def _attention(self, x, mask, prefix):
        w, length = self.weights, x.shape[0]
        qkv = (x @ w[f"{prefix}.query_key_value.weight"].T).view(
            length, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        q = rms_norm(q, w[f"{prefix}.query_layernorm.weight"], self.eps).transpose(0, 1)
        k = rms_norm(k, w[f"{prefix}.key_layernorm.weight"], self.eps).transpose(0, 1)
        positions = torch.arange(length)
        q, k = self._rope(q, positions), self._rope(k, positions)
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=0)
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(self.head_dim)
        out = scores.masked_fill(~mask[None], float("-inf")).softmax(-1) @ v
        out = out.transpose(0, 1).reshape(length, -1) @ w[f"{prefix}.dense.weight"].T
        bias = w.get(f"{prefix}.dense.bias")
        return out if bias is None else out + bias

    def _swiglu(self, x, prefix):
        w = self.weights
        return (F.silu(x @ w[f"{prefix}.gate_proj.weight"].T)
                * (x @ w[f"{prefix}.up_proj.weight"].T)) @ w[f"{prefix}.down_proj.weight"].T

    def _route(self, logits, expert_bias):
        """(weights [T, k], experts [T, k]) of the sequence's tokens."""
        cfg = self.config
        return reference_route(logits, expert_bias, cfg["num_experts_per_tok"], cfg["n_group"],
                               cfg["topk_group"], cfg["routed_scaling_factor"])

    def _mlp(self, x, prefix):
        w = self.weights
        if f"{prefix}.gate.weight" not in w:
            return self._swiglu(x, prefix)
        logits = x.float() @ w[f"{prefix}.gate.weight"].float().T
        weights, experts = self._route(logits, w[f"{prefix}.gate.expert_bias"])
        out = torch.zeros_like(x)
        for token in range(x.shape[0]):
            for weight, expert in zip(weights[token], experts[token].tolist()):
                out[token] += weight * self._swiglu(x[token:token + 1],
                                                    f"{prefix}.experts.{expert}")[0]
        return out + self._swiglu(x, f"{prefix}.shared_experts")

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """token_ids [L]; mask [L, L] bool. Returns logits [L, vocab]."""
        w = self.weights
        h = w["model.word_embeddings.weight"][token_ids]
        for i in range(self.num_layers):
            p = f"model.layers.{i}"
            h = h + self._attention(rms_norm(h, w[f"{p}.input_layernorm.weight"], self.eps), mask,
                                    f"{p}.attention")
            h = h + self._mlp(rms_norm(h, w[f"{p}.post_attention_layernorm.weight"], self.eps),
                              f"{p}.mlp")
        return rms_norm(h, w["model.norm.weight"], self.eps) @ w["lm_head.weight"].T

    __call__ = forward


@torch.no_grad()
def reference_generate_editing(model, prompt_ids: list[int], *, block_size: int, mask_id: int,
                               max_tokens: int, strategy: str, threshold: float,
                               editing_threshold: float, max_post_steps: int,
                               denoising_steps: int | None = None,
                               stop_token_ids=frozenset()) -> tuple[list[int], list[int]]:
    """LLaDA2.1 decoding (mask-to-token filling plus token-to-token editing), greedy, on
    the block-causal cache-free forward. Returns (output tokens, step map).

    Per block, each step: one forward; if masks remain, the strategy fills some (as SDAR);
    every position that was filled before this step (never a prompt position) takes the
    model's token where it differs and its probability exceeds ``editing_threshold``. As in
    the published loop, masks are looked for at the start of each step: a step that starts
    with none is a post step (counted), and the block ends after a post step that edited
    nothing; a post step would exceed ``max_post_steps``, the block ends before it (so
    with 0 it ends right after its last mask is filled). A token's step is the step of its
    last change.
    """
    from reference_sdar import block_causal_mask, select_positions, transfer_quotas

    steps = denoising_steps or block_size
    quotas = transfer_quotas(block_size, steps)
    prompt_len = len(prompt_ids)
    start = prompt_len // block_size * block_size
    committed = list(prompt_ids[:start])
    block = torch.tensor(prompt_ids[start:] + [mask_id] * (block_size - prompt_len % block_size))
    output, step_map, forwards = [], [], 0
    while True:
        fixed = torch.arange(block_size) < max(0, prompt_len - start)  # prompt positions
        changed_at = torch.full((block_size,), -1)
        step, post_steps = 0, 0
        while True:
            masked = block == mask_id
            began_unmasked = not bool(masked.any())
            if began_unmasked:
                post_steps += 1
                if post_steps > max_post_steps:
                    break
            tokens = torch.cat((torch.tensor(committed, dtype=torch.long), block))
            logits = model.forward(tokens, block_causal_mask(len(tokens), block_size))[-block_size:]
            logits[:, mask_id] = float("-inf")
            probs = logits.float().softmax(-1)
            confidence, proposal = probs.max(-1)
            new_block = block.clone()
            if bool(masked.any()):
                quota = quotas[step] if step < steps else block_size
                scored = torch.where(masked, confidence, torch.full_like(confidence, float("-inf")))
                fill = select_positions(strategy, scored, masked, quota, threshold,
                                        last_step=step >= steps - 1)
                new_block = torch.where(fill, proposal, new_block)
                changed_at[fill] = forwards
            edit = (~masked & ~fixed & (proposal != block) & (confidence > editing_threshold))
            new_block = torch.where(edit, proposal, new_block)
            changed_at[edit] = forwards
            block = new_block
            forwards += 1
            step += 1
            if began_unmasked and not bool(edit.any()):
                break
            assert step <= 64 * block_size
        for position, token in enumerate(block.tolist(), start=start):
            if position < prompt_len:
                continue
            output.append(token)
            step_map.append(int(changed_at[position - start]))
            if token in stop_token_ids or len(output) == max_tokens:
                return output, step_map
        committed += block.tolist()
        start += block_size
        block = torch.full((block_size,), mask_id)
