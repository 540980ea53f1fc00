"""SDAR models: Qwen3 / Qwen3-MoE weights and layers with block-diffusion attention.

SDAR's architecture is Qwen3 verbatim (weights, names, q/k-norm before RoPE); only the
attention mask and the decoding loop differ. The layers here are built from vLLM's own
modules (tensor-parallel linears, RMSNorm, RoPE, Qwen3's MLP and MoE block), with names
that match Qwen3's, so vLLM's weight loading applies unchanged; their attention is built
on ``BlockDiffusionAttentionBackend`` from the start. ``SDARDecoderLayer`` owns its
forward (Qwen3's pre-norm residual order) and calls the step run's hook points
(``step_run.py``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.qwen2 import Qwen2MLP
from vllm.model_executor.models.interfaces import MixtureOfExperts
from vllm.model_executor.models.qwen3 import Qwen3Model
from vllm.model_executor.models.qwen3_moe import Qwen3MoeModel, Qwen3MoeSparseMoeBlock
from vllm.model_executor.models.utils import PPMissingLayer, extract_layer_index
from vllm.transformers_utils.config import set_default_rope_theta

from vllm_diffusion.models.attention_heads import init_block_diffusion_heads
from vllm_diffusion.models.causal_lm import DiffusionCausalLM, PreNormHalves, run_layers
from vllm_diffusion.models.step_run import StepRun


class SDARAttention(nn.Module):
    """Qwen3's attention (q/k RMSNorm per head before RoPE), split into ``project`` and
    ``attend`` so that hooks can run between the keys/values and the attention."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        total_heads, total_kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        init_block_diffusion_heads(self, config, vllm_config, prefix, head_dim)
        quant_config = vllm_config.quant_config
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, total_heads, total_kv_heads,
            bias=getattr(config, "attention_bias", False), quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size,
                                        bias=False, quant_config=quant_config,
                                        prefix=f"{prefix}.o_proj")
        self.rotary_emb = get_rope(self.head_dim,
                                   max_position=getattr(config, "max_position_embeddings", 8192),
                                   rope_parameters=config.rope_parameters)
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

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Stores the keys/values of all k rows, attends for the q rows: [T_q, hidden]."""
        output, _ = self.o_proj(self.attn(q, k, v))
        return output


class SDARDecoderLayer(PreNormHalves, nn.Module):
    """Qwen3's decoder layer (dense MLP, or Qwen3-MoE's sparse block where the config
    puts one) on ``SDARAttention``."""

    def __init__(self, *, prefix: str = "", vllm_config: VllmConfig | None = None,
                 **unused) -> None:
        # Qwen3's model passes (config, cache_config, quant_config), Qwen3-MoE's the whole
        # vllm_config; both are the config being built.
        super().__init__()
        vllm_config = vllm_config or get_current_vllm_config()
        config = vllm_config.model_config.hf_text_config
        set_default_rope_theta(config, default_theta=1000000)
        self.self_attn = SDARAttention(config, vllm_config, f"{prefix}.self_attn")
        self.layer_index = layer = extract_layer_index(prefix)
        sparse = (getattr(config, "num_experts", 0) > 0
                  and layer not in getattr(config, "mlp_only_layers", [])
                  and (layer + 1) % getattr(config, "decoder_sparse_step", 1) == 0)
        if sparse:
            self.mlp = Qwen3MoeSparseMoeBlock(vllm_config=vllm_config, prefix=f"{prefix}.mlp")
        else:
            self.mlp = Qwen2MLP(hidden_size=config.hidden_size,
                                intermediate_size=config.intermediate_size,
                                hidden_act=config.hidden_act,
                                quant_config=vllm_config.quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)



    @property
    def attention_module(self) -> nn.Module:
        """The attention of its layer body (``PreNormHalves``: Qwen3's pre-norm order)."""
        return self.self_attn


class SDARModel(Qwen3Model):
    """Qwen3's model (embedding, layers, norm, weight loading) on ``SDARDecoderLayer``."""

    decoder_layer_type = SDARDecoderLayer

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)

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


class SDARForCausalLM(DiffusionCausalLM):
    """The model, its LM head and logits, with Qwen3's weight names."""

    model_cls = SDARModel
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                              "gate_up_proj": ["gate_proj", "up_proj"]}
    embedding_modules = {"embed_tokens": "input_embeddings", "lm_head": "output_embeddings"}


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
