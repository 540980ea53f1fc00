"""LLaDA 1.x (``LLaDAModelLM``, ``model_type: llada``; LLaDA-8B-Base/Instruct, LLaDA-1.5):
the published ``modeling_llada.py`` network for ``block_type: llama`` (a Llama-style
masked-diffusion model whose every position attends to every other), built from vLLM's
layers under the published weight names; docs/models.md, "LLaDA 1.x".
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.utils import WeightsMapper, extract_layer_index, make_layers

from vllm_diffusion.models.attention_heads import init_block_diffusion_heads
from vllm_diffusion.models.causal_lm import (DiffusionCausalLM, PreNormHalves, SwiGLUMLP,
                                             run_layers)
from vllm_diffusion.models.step_run import StepRun


class LLaDAAttention(nn.Module):
    """Packed q/k/v, RoPE, the attention and ``attn_out``; ``project`` / ``attend`` as
    ``SDARAttention`` (no q/k norm)."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        init_block_diffusion_heads(self, config, vllm_config, prefix, config.head_dim)
        quant_config = vllm_config.quant_config
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads,
            config.num_key_value_heads,
            bias=bool(config.include_bias or config.include_qkv_bias),
            quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size, bias=config.include_bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        # rope_full_precision: q and k rotated in float32 and cast back (the published rule)
        self.rope_full_precision = bool(config.rope_full_precision)
        self.rotary_emb = get_rope(
            self.head_dim, max_position=config.max_position_embeddings, is_neox_style=True,
            rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
            dtype=torch.float32 if self.rope_full_precision else None)

    def project(self, positions: torch.Tensor, hidden_states: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [T, H * D], keys and values [T, H_kv * D], after RoPE."""
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if not self.rope_full_precision:
            q, k = self.rotary_emb(positions, q, k)
            return q, k, v
        q32, k32 = self.rotary_emb(positions, q.float(), k.float())
        return q32.to(q.dtype), k32.to(k.dtype), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Stores the keys/values of all k rows, attends for the q rows: [T_q, hidden]."""
        output, _ = self.o_proj(self.attn(q, k, v))
        return output


class LLaDADecoderLayer(PreNormHalves, nn.Module):
    """The published ``LLaDALlamaBlock`` (pre-norm: ``PreNormHalves``)."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        self.layer_index = extract_layer_index(prefix)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = LLaDAAttention(config, vllm_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # the checkpoint's ``ff_proj`` is the gate (shard 0 of ``gate_up_proj``), ``up_proj``
        # the up (shard 1)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, config.include_bias,
                             vllm_config, f"{prefix}.mlp")


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1})
class LLaDAModel(nn.Module):
    """Embedding (``embedding_size`` rows), the blocks and the final norm."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        unserved = config.unserved_settings()
        if unserved:
            raise NotImplementedError(f"LLaDA checkpoint with {', '.join(unserved)}")
        norm_bias = (config.include_bias if config.bias_for_layer_norm is None
                     else config.bias_for_layer_norm)
        if norm_bias:  # the published rule: bias_for_layer_norm, else include_bias
            raise NotImplementedError("LLaDA checkpoint with layer-norm biases")
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.embed_tokens")
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: LLaDADecoderLayer(config, vllm_config, prefix),
            prefix=f"{prefix}.layers")
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds=None,
                stack_run: StepRun | None = None) -> torch.Tensor:
        return run_layers(self, input_ids, positions, stack_run)


class LLaDAModelLM(DiffusionCausalLM):
    """The model, its output layer (tied to ``wte`` where ``weight_tying``) and logits,
    loading the published weight names."""

    model_cls = LLaDAModel
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                              "gate_up_proj": ["gate_proj", "up_proj"]}
    embedding_modules = {"embed_tokens": "input_embeddings", "lm_head": "output_embeddings"}
    # Applied in order: the renames (the output layer first, as the blocks also have an
    # ``ff_out``), then the packed projections.
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_substr={
            "model.transformer.ff_out.": "lm_head.",
            "model.transformer.wte.": "model.embed_tokens.",
            "model.transformer.ln_f.": "model.norm.",
            "model.transformer.blocks.": "model.layers.",
            ".attn_norm.": ".input_layernorm.",
            ".attn_out.": ".self_attn.o_proj.",
            ".ff_norm.": ".post_attention_layernorm.",
            ".ff_out.": ".mlp.down_proj.",
        },
        orig_to_new_stacked={
            ".q_proj.": (".self_attn.qkv_proj.", "q"),
            ".k_proj.": (".self_attn.qkv_proj.", "k"),
            ".v_proj.": (".self_attn.qkv_proj.", "v"),
            ".ff_proj.": (".mlp.gate_up_proj.", 0),
            ".up_proj.": (".mlp.gate_up_proj.", 1),
        })
