"""The conversion of SmolLM2-135M-Instruct (Llama) to block diffusion in Fast-dLLM v2's
form: shifted logits (block position j is read from row j - 1, so a block's first token is
the autoregressive prediction of the row before it) under block-causal attention (a
position sees its own block and every earlier one), trained with complementary masks.

Each sequence (prompt + answer + stop tokens to its block's end) is laid out three times:
``[clean | noisy A | noisy B]``, positions repeating. The clean copy attends block-causally
to itself, as the engine's committed KV does; each noisy copy's block b attends to the
clean blocks before b and to its own block (both ways), as a block being denoised does.
A and B mask complementary sets of the answer positions that are not a block's first
(those are never masks at inference: the engine reads them from the previous row after the
commit). Loss: cross-entropy at every masked position p, read from row p - 1 of the copy
that masks it, and at every block-first answer position, read from row p - 1 of the clean
copy (the commit's autoregressive step). So each answer token is a target exactly once.

The trainable parameters are a LoRA (rank ``r`` on q, k, v, o, gate, up and down of every
layer), every RMSNorm weight, and the mask token's embedding row; the base weights are
frozen (the adapter is what the repository stores). The forward is written here in plain
PyTorch from the Llama semantics (pre-norm RMSNorm, rotate-half RoPE, grouped-query
attention, SwiGLU, tied head), so that the attention mask is the layout's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

MASK_TOKEN_ID = 16  # ``<empty_output>``: an unused special token of SmolLM2's tokenizer
STOP_TOKEN_ID = 2   # ``<|im_end|>``
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LlamaShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    eps: float

    @classmethod
    def from_config(cls, config: dict) -> "LlamaShape":
        theta = (config.get("rope_parameters") or {}).get("rope_theta") \
            or config.get("rope_theta", 10000.0)
        return cls(config["num_hidden_layers"], config["hidden_size"],
                   config["num_attention_heads"], config["num_key_value_heads"],
                   config.get("head_dim") or
                   config["hidden_size"] // config["num_attention_heads"],
                   float(theta), float(config["rms_norm_eps"]))


def _module(name: str) -> str:
    return "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"


class ConversionModel(torch.nn.Module):
    """Frozen Llama weights (``base``: the checkpoint's state dict) and the trainable
    adapter: LoRA factors, norm weights and the mask row."""

    def __init__(self, base: dict[str, torch.Tensor], shape: LlamaShape, rank: int = 16,
                 alpha: float = 32.0, seed: int = 0, full: bool = False) -> None:
        """``full``: every layer's linear weights trained too (full fine-tuning, the
        comparison the adapter was chosen against; the embedding stays frozen)."""
        super().__init__()
        self.shape, self.rank, self.scale = shape, rank, alpha / rank
        self.base = {k: v.float().requires_grad_(False) for k, v in base.items()}
        self.full_weights = torch.nn.ParameterDict()
        if full:
            for key in list(self.base):
                if key.endswith("proj.weight"):
                    self.full_weights[key.replace(".", "_")] = torch.nn.Parameter(
                        self.base[key].clone())
                    self.base[key] = self.full_weights[key.replace(".", "_")]
        gen = torch.Generator().manual_seed(seed)
        self.lora_a = torch.nn.ParameterDict()
        self.lora_b = torch.nn.ParameterDict()
        for i in range(0 if full else shape.layers):
            for name in LORA_TARGETS:
                w = self.base[f"model.layers.{i}.{_module(name)}.{name}.weight"]
                key = f"{i}_{name}"
                self.lora_a[key] = torch.nn.Parameter(
                    torch.randn(rank, w.shape[1], generator=gen) / math.sqrt(w.shape[1]))
                self.lora_b[key] = torch.nn.Parameter(torch.zeros(w.shape[0], rank))
        self.norms = torch.nn.ParameterDict({
            k.replace(".", "_"): torch.nn.Parameter(v.clone())
            for k, v in self.base.items() if k.endswith("norm.weight")})
        embed = self.base["model.embed_tokens.weight"]
        self.mask_row = torch.nn.Parameter(embed[MASK_TOKEN_ID].clone())

    def _linear(self, x: torch.Tensor, layer: int, name: str) -> torch.Tensor:
        w = self.base[f"model.layers.{layer}.{_module(name)}.{name}.weight"]
        key = f"{layer}_{name}"
        if key not in self.lora_a:  # full fine-tuning
            return F.linear(x, w)
        return F.linear(x, w) + F.linear(F.linear(x, self.lora_a[key]),
                                         self.lora_b[key]) * self.scale

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w = self.norms[name.replace(".", "_")]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.shape.eps) * w

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [batch, heads, rows, head_dim]; positions: [batch, rows]
        d = self.shape.head_dim
        inv = 1.0 / (self.shape.rope_theta ** (torch.arange(0, d, 2).float() / d))
        angles = positions[..., None].float() * inv  # [batch, rows, d / 2]
        cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None]
        sin = torch.cat((angles.sin(), angles.sin()), -1)[:, None]
        half = d // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
        return x * cos + rotated * sin

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor
               ) -> torch.Tensor:
        """Final-norm hidden states [batch, rows, hidden]; ``visible`` [batch, rows, rows]
        says which key each query row sees."""
        s = self.shape
        embed = self.base["model.embed_tokens.weight"]
        x = embed[ids]
        is_mask = (ids == MASK_TOKEN_ID)[..., None]
        x = torch.where(is_mask, self.mask_row.to(x.dtype), x)
        batch, rows, _ = x.shape
        attn_mask = visible[:, None]
        for i in range(s.layers):
            h = self._norm(x, f"model.layers.{i}.input_layernorm.weight")
            q = self._linear(h, i, "q_proj").view(batch, rows, s.heads, s.head_dim)
            k = self._linear(h, i, "k_proj").view(batch, rows, s.kv_heads, s.head_dim)
            v = self._linear(h, i, "v_proj").view(batch, rows, s.kv_heads, s.head_dim)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            q, k = self._rope(q, positions), self._rope(k, positions)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                                 enable_gqa=True)
            x = x + self._linear(out.transpose(1, 2).reshape(batch, rows, -1), i, "o_proj")
            h = self._norm(x, f"model.layers.{i}.post_attention_layernorm.weight")
            x = x + self._linear(F.silu(self._linear(h, i, "gate_proj"))
                                 * self._linear(h, i, "up_proj"), i, "down_proj")
        return self._norm(x, "model.norm.weight")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.base["model.embed_tokens.weight"])

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """What the repository stores: LoRA factors, norm weights, the mask row."""
        state = {f"lora_a.{k}": v.detach() for k, v in self.lora_a.items()}
        state.update({f"lora_b.{k}": v.detach() for k, v in self.lora_b.items()})
        state.update({f"norm.{k.replace('.', '/')}": self.norms[k.replace(".", "_")].detach()
                      for k in self.base if k.endswith("norm.weight")})
        state["mask_row"] = self.mask_row.detach()
        state.update({f"full.{k}": v.detach() for k, v in self.full_weights.items()})
        return state

    def load_adapter(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for key, value in state.items():
                kind, _, name = key.partition(".")
                target = {"lora_a": self.lora_a, "lora_b": self.lora_b}.get(kind)
                if kind == "full":
                    self.full_weights[name].copy_(value.float())
                elif kind == "norm":
                    self.norms[name.replace("/", "_").replace(".", "_")].copy_(value.float())
                elif target is not None:
                    target[name].copy_(value.float())
                elif key == "mask_row":
                    self.mask_row.copy_(value.float())


def merged_weights(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor],
                   scale: float) -> dict[str, torch.Tensor]:
    """The converted checkpoint's weights: base + B @ A * scale on every LoRA target
    (in float64, rounded once to float32), the adapter's norms, and the mask row in the
    (tied) embedding."""
    merged = {k: v.float().clone() for k, v in base.items()}
    for key, a in adapter.items():
        kind, _, name = key.partition(".")
        if kind == "lora_a":
            layer, proj = name.split("_", 1)
            target = f"model.layers.{layer}.{_module(proj)}.{proj}.weight"
            b = adapter[f"lora_b.{name}"].double()
            merged[target] = (merged[target].double() + (b @ a.double()) * scale).float()
        elif kind == "norm":
            merged[name.replace("/", ".")] = adapter[key].float()
    merged["model.embed_tokens.weight"][MASK_TOKEN_ID] = adapter["mask_row"].float()
    return merged
