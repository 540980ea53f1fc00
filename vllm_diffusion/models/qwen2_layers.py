"""Qwen2's layers on the block-diffusion attention backend, for the families with Qwen2 /
Qwen2.5 weights (Dream, Fast-dLLM v2), with Qwen2's weight names so that vLLM's Qwen2 model
loads them; SDAR's Qwen3 layers (``sdar.py``) extend them. How rows attend (full or
block-causal) is the engine's, from the family's capabilities.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.qwen2 import Qwen2MLP, Qwen2Model
from vllm.model_executor.models.utils import extract_layer_index
from vllm.transformers_utils.config import set_default_rope_theta

from vllm_diffusion.models.attention_heads import init_block_diffusion_heads
from vllm_diffusion.models.causal_lm import DiffusionCausalLM, PreNormHalves, run_layers
from vllm_diffusion.models.step_run import StepRun


class Qwen2DiffusionAttention(nn.Module):
    """Qwen2's attention (q/k/v biases unless ``qkv_bias`` says otherwise, no q/k norm),
    split into ``project`` and ``attend`` so that hooks can run between the keys/values
    and the attention."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str,
                 qkv_bias: bool = True) -> None:
        super().__init__()
        total_heads, total_kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        init_block_diffusion_heads(self, config, vllm_config, prefix, head_dim)
        quant_config = vllm_config.quant_config
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, total_heads, total_kv_heads, bias=qkv_bias,
            quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size,
                                        bias=False, quant_config=quant_config,
                                        prefix=f"{prefix}.o_proj")
        self.rotary_emb = get_rope(self.head_dim,
                                   max_position=getattr(config, "max_position_embeddings", 8192),
                                   rope_parameters=config.rope_parameters)

    def project(self, positions: torch.Tensor, hidden_states: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [T, H * D], keys and values [T, H_kv * D], after RoPE."""
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Stores the keys/values of all k rows, attends for the q rows: [T_q, hidden]."""
        output, _ = self.o_proj(self.attn(q, k, v))
        return output


class Qwen2DiffusionDecoderLayer(PreNormHalves, nn.Module):
    """Qwen2's decoder layer (its pre-norm order: ``PreNormHalves``) on ``attention_cls``."""

    attention_cls: type[nn.Module] = Qwen2DiffusionAttention
    default_rope_theta = 10000

    def __init__(self, *, prefix: str = "", vllm_config: VllmConfig | None = None,
                 **unused) -> None:
        # Qwen2's and Qwen3's models pass (config, cache_config, quant_config), Qwen3-MoE's
        # the whole vllm_config; all are parts of the config being built.
        super().__init__()
        vllm_config = vllm_config or get_current_vllm_config()
        config = vllm_config.model_config.hf_text_config
        set_default_rope_theta(config, default_theta=self.default_rope_theta)
        self.layer_index = extract_layer_index(prefix)
        self.self_attn = self.attention_cls(config, vllm_config, f"{prefix}.self_attn")
        self.mlp = self.make_mlp(config, vllm_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def make_mlp(self, config, vllm_config: VllmConfig, prefix: str) -> nn.Module:
        return Qwen2MLP(hidden_size=config.hidden_size,
                        intermediate_size=config.intermediate_size,
                        hidden_act=config.hidden_act, quant_config=vllm_config.quant_config,
                        prefix=prefix)


class Qwen2DiffusionModel(Qwen2Model):
    """Qwen2's model (embedding, layers, norm, weight loading) on
    ``Qwen2DiffusionDecoderLayer``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix,
                         decoder_layer_type=Qwen2DiffusionDecoderLayer)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds=None,
                stack_run: StepRun | None = None) -> torch.Tensor:
        return run_layers(self, input_ids, positions, stack_run)


class Qwen2DiffusionForCausalLM(DiffusionCausalLM):
    """Qwen2's model, its LM head (tied where the config says) and per-row logits, with
    Qwen2's weight names."""

    model_cls = Qwen2DiffusionModel
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                              "gate_up_proj": ["gate_proj", "up_proj"]}
    embedding_modules = {"embed_tokens": "input_embeddings", "lm_head": "output_embeddings"}
