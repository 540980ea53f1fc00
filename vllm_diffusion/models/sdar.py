"""SDAR models: Qwen3 / Qwen3-MoE weights and layers with block-diffusion attention.

SDAR's architecture is Qwen3 verbatim (weights, names, q/k-norm before RoPE); only the
attention mask and the decoding loop differ. The layers here are built from vLLM's own
modules (tensor-parallel linears, RMSNorm, RoPE, Qwen3's MLP and MoE block), with names
that match Qwen3's, so vLLM's weight loading applies unchanged; their attention is built
on ``BlockDiffusionAttentionBackend`` from the start. Each layer exposes the pieces the
decoder stack (``decoder_stack.py``) calls one by one, so a policy's hooks run between
them on any model registered here.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.qwen2 import Qwen2MLP
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM, Qwen3Model
from vllm.model_executor.models.qwen3_moe import (Qwen3MoeForCausalLM, Qwen3MoeModel,
                                                  Qwen3MoeSparseMoeBlock)
from vllm.model_executor.models.utils import PPMissingLayer, extract_layer_index, maybe_prefix
from vllm.transformers_utils.config import set_default_rope_theta

from vllm_diffusion.attention.backend import BlockDiffusionAttentionBackend
from vllm_diffusion.models.decoder_stack import StackRun, run_decoder_stack


def init_block_diffusion_heads(module: nn.Module, config, vllm_config: VllmConfig, prefix: str,
                               head_dim: int) -> None:
    """This rank's head counts and sizes on ``module`` (``num_heads``, ``num_kv_heads``,
    ``head_dim``, ``q_size``, ``kv_size``, ``scaling``) and its block-diffusion
    ``attn`` (``{prefix}.attn``)."""
    tp_size = get_tensor_model_parallel_world_size()
    total_heads, total_kv_heads = config.num_attention_heads, config.num_key_value_heads
    if total_heads % tp_size or (total_kv_heads % tp_size and tp_size % total_kv_heads):
        raise ValueError(f"{total_heads} attention / {total_kv_heads} KV heads cannot be "
                         f"split over tensor-parallel size {tp_size}")
    module.num_heads = total_heads // tp_size
    module.num_kv_heads = max(1, total_kv_heads // tp_size)
    module.head_dim = head_dim
    module.q_size = module.num_heads * head_dim
    module.kv_size = module.num_kv_heads * head_dim
    module.scaling = head_dim ** -0.5
    module.attn = Attention(module.num_heads, head_dim, module.scaling,
                            num_kv_heads=module.num_kv_heads,
                            cache_config=vllm_config.cache_config,
                            quant_config=vllm_config.quant_config, prefix=f"{prefix}.attn",
                            attn_backend=BlockDiffusionAttentionBackend)


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


class SDARDecoderLayer(nn.Module):
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
        layer = extract_layer_index(prefix)
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


class SDARModel(Qwen3Model):
    decoder_layer_type = SDARDecoderLayer

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds=None,
                stack_run: StackRun | None = None) -> torch.Tensor:
        return run_decoder_stack(self, input_ids, positions, stack_run)


class SDARMoeModel(Qwen3MoeModel):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix,
                         decoder_layer_type=SDARDecoderLayer)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds=None,
                stack_run: StackRun | None = None) -> torch.Tensor:
        return run_decoder_stack(self, input_ids, positions, stack_run)


def _build_causal_lm(lm: nn.Module, model_cls: type, vllm_config: VllmConfig,
                     prefix: str) -> None:
    """What Qwen3's and Qwen3-MoE's ``*ForCausalLM.__init__`` build, on ``model_cls``."""
    if get_pp_group().world_size > 1:
        raise NotImplementedError("block-diffusion models do not support pipeline parallelism")
    config = vllm_config.model_config.hf_text_config
    lm.config = config
    lm.vllm_config = vllm_config
    lm.quant_config = vllm_config.quant_config
    lm.model = model_cls(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
    lm.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                quant_config=vllm_config.quant_config,
                                prefix=maybe_prefix(prefix, "lm_head"))
    if config.tie_word_embeddings:
        lm.lm_head = lm.lm_head.tie_weights(lm.model.embed_tokens)
    lm.logits_processor = LogitsProcessor(config.vocab_size)
    lm.make_empty_intermediate_tensors = lm.model.make_empty_intermediate_tensors


class SDARForCausalLM(Qwen3ForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        _build_causal_lm(self, SDARModel, vllm_config, prefix)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds=None,
                stack_run: StackRun | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, stack_run=stack_run)


class SDARMoeForCausalLM(Qwen3MoeForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        _build_causal_lm(self, SDARMoeModel, vllm_config, prefix)
        # Expert bookkeeping Qwen3-MoE exposes (vLLM's MixtureOfExperts interface).
        sparse = [layer.mlp for layer in self.model.layers
                  if not isinstance(layer, PPMissingLayer)
                  and isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)]
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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds=None,
                stack_run: StackRun | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, stack_run=stack_run)
