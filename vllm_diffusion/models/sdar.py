"""SDAR models: Qwen3 / Qwen3-MoE weights, names and layers (q/k-norm before RoPE) with
block-diffusion attention; only the attention mask and the decoding loop differ from Qwen3.
The layers extend ``qwen2_layers``' with Qwen3's q/k norm and MoE block, so vLLM's weight
loading applies unchanged.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.models.interfaces import MixtureOfExperts
from vllm.model_executor.models.qwen3 import Qwen3Model
from vllm.model_executor.models.qwen3_moe import Qwen3MoeModel, Qwen3MoeSparseMoeBlock
from vllm.model_executor.models.utils import PPMissingLayer

from vllm_diffusion.models.causal_lm import run_layers
from vllm_diffusion.models.qwen2_layers import (Qwen2DiffusionAttention,
                                                Qwen2DiffusionDecoderLayer,
                                                Qwen2DiffusionForCausalLM)
from vllm_diffusion.models.step_run import StepRun


class SDARAttention(Qwen2DiffusionAttention):
    """Qwen3's attention: Qwen2's with q/k RMSNorm per head before RoPE, q/k/v biases only
    where ``attention_bias``."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__(config, vllm_config, prefix,
                         qkv_bias=getattr(config, "attention_bias", False))
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project(self, positions: torch.Tensor, hidden_states: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [T, H * D], keys and values [T, H_kv * D], after q/k-norm and RoPE."""
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(*q.shape[:-1], self.num_heads, self.head_dim)).view(q.shape)
        k = self.k_norm(k.view(*k.shape[:-1], self.num_kv_heads, self.head_dim)).view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v


class SDARDecoderLayer(Qwen2DiffusionDecoderLayer):
    """Qwen3's decoder layer (dense MLP, or Qwen3-MoE's sparse block where the config
    puts one) on ``SDARAttention``."""

    attention_cls = SDARAttention
    default_rope_theta = 1000000

    def make_mlp(self, config, vllm_config: VllmConfig, prefix: str) -> nn.Module:
        layer = self.layer_index
        if (getattr(config, "num_experts", 0) > 0
                and layer not in getattr(config, "mlp_only_layers", [])
                and (layer + 1) % getattr(config, "decoder_sparse_step", 1) == 0):
            return Qwen3MoeSparseMoeBlock(vllm_config=vllm_config, prefix=prefix)
        return super().make_mlp(config, vllm_config, prefix)


class SDARModel(Qwen3Model):
    """Qwen3's model (embedding, layers, norm, weight loading) on ``SDARDecoderLayer``."""

    decoder_layer_type = SDARDecoderLayer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds=None,
                stack_run: StepRun | None = None) -> torch.Tensor:
        return run_layers(self, input_ids, positions, stack_run)


class SDARMoeModel(Qwen3MoeModel):
    """Qwen3-MoE's model on ``SDARDecoderLayer``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix,
                         decoder_layer_type=SDARDecoderLayer)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds=None,
                stack_run: StepRun | None = None) -> torch.Tensor:
        return run_layers(self, input_ids, positions, stack_run)


class SDARForCausalLM(Qwen2DiffusionForCausalLM):
    """The model, its LM head and logits, with Qwen3's weight names (Qwen2's packing)."""

    model_cls = SDARModel


class SDARMoeForCausalLM(SDARForCausalLM, MixtureOfExperts):
    """SDAR-MoE: Qwen3-MoE's sparse blocks, with vLLM's expert bookkeeping."""

    model_cls = SDARMoeModel
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        sparse = self._sparse_blocks()
        if not sparse:
            raise RuntimeError("the SDAR MoE config puts no sparse MoE block in any layer")
        self.moe_layers = [mlp.experts for mlp in sparse]
        self.num_moe_layers = len(self.moe_layers)
        self.num_expert_groups = 1
        self.num_shared_experts = 0
        example = sparse[0]
        self.num_logical_experts = example.n_logical_experts
        self.num_physical_experts = example.n_physical_experts
        self.num_local_physical_experts = example.n_local_physical_experts
        self.num_routed_experts = example.n_routed_experts
        self.num_redundant_experts = example.n_redundant_experts

    def _sparse_blocks(self) -> list[Qwen3MoeSparseMoeBlock]:
        return [layer.mlp for layer in self.model.layers
                if not isinstance(layer, PPMissingLayer)
                and isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)]

    def update_physical_experts_metadata(self, num_physical_experts: int,
                                         num_local_physical_experts: int) -> None:
        self.num_physical_experts = num_physical_experts
        self.num_local_physical_experts = num_local_physical_experts
        self.num_redundant_experts = num_physical_experts - self.num_logical_experts
        for moe in self._sparse_blocks():
            moe.n_local_physical_experts = num_local_physical_experts
            moe.n_physical_experts = num_physical_experts
            moe.n_redundant_experts = self.num_redundant_experts
            moe.experts.update_expert_map()
