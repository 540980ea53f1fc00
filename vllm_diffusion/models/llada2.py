"""LLaDA2.0 / LLaDA2.1 / LLaDA2.2 (``LLaDA2MoeModelLM``, ``model_type: llada2_moe``) with
block-diffusion attention: Ling-2.0's architecture (vLLM's ``BailingMoeV2``) built from
vLLM's layers with the published ``modeling_llada2_moe.py`` semantics where vLLM's Bailing
model differs, and LLaDA2.2's block routing (``expert_capacity > 0``); docs/models.md,
"LLaDA2.0 and LLaDA2.1" and "LLaDA2.2".
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.fused_moe import FusedMoEFactory
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.utils import WeightsMapper, extract_layer_index, make_layers

from vllm_diffusion.models.attention_heads import init_block_diffusion_heads
from vllm_diffusion.models.causal_lm import (DiffusionCausalLM, PreNormHalves, SwiGLUMLP,
                                             run_layers)
from vllm_diffusion.models.step_run import StepRun


class LLaDA2Attention(nn.Module):
    def __init__(self, config, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        total_heads, total_kv_heads = config.num_attention_heads, config.num_key_value_heads
        init_block_diffusion_heads(self, config, vllm_config, prefix, config.head_dim)
        quant_config = vllm_config.quant_config
        self.query_key_value = QKVParallelLinear(
            config.hidden_size, self.head_dim, total_heads, total_kv_heads,
            bias=config.use_qkv_bias, quant_config=quant_config,
            prefix=f"{prefix}.query_key_value")
        self.dense = RowParallelLinear(total_heads * self.head_dim, config.hidden_size,
                                       bias=config.use_bias, quant_config=quant_config,
                                       prefix=f"{prefix}.dense")
        self.use_qk_norm = config.use_qk_norm
        if self.use_qk_norm:
            self.query_layernorm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.key_layernorm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = get_rope(
            self.head_dim, max_position=config.max_position_embeddings, is_neox_style=True,
            rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta,
                             "partial_rotary_factor": config.partial_rotary_factor})

    def project(self, positions: torch.Tensor, hidden_states: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [T, H * D], keys and values [T, H_kv * D], after q/k-norm and RoPE."""
        qkv, _ = self.query_key_value(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.use_qk_norm:
            q = self.query_layernorm(q.view(-1, self.num_heads, self.head_dim)).view(q.shape)
            k = self.key_layernorm(k.view(-1, self.num_kv_heads, self.head_dim)).view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        output, _ = self.dense(self.attn(q, k, v))
        return output


def chosen_weights(scores: torch.Tensor, ids: torch.Tensor, scaling: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen experts' unbiased scores ([T, k] of ``scores`` [T, E] at ``ids``),
    renormalised when k > 1 (whatever ``norm_topk_prob`` says), times ``scaling``."""
    weights = scores.gather(1, ids)
    if ids.shape[1] > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def route(hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int,
          renormalize: bool, *, expert_bias: torch.Tensor, num_groups: int, topk_group: int,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The published router: ([T, k] weights, [T, k] expert ids) from fp32 logits [T, E]."""
    scores = torch.sigmoid(gating_output.float())  # [T, E]
    biased = scores + expert_bias.float()  # for selection only
    tokens, experts = scores.shape
    grouped = biased.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    best_groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    biased = biased.masked_fill(~keep.repeat_interleave(experts // num_groups, dim=1),
                                float("-inf"))
    return chosen_weights(scores, biased.topk(topk, dim=-1).indices, scaling)


def routing_blocks(positions: torch.Tensor, routing_block_size: int) -> torch.Tensor:
    """[T] int64: each row's routing block, numbered from 0 in row order.

    A routing block is ``routing_block_size`` tokens of one request by absolute position.
    The engine lays each request's rows out contiguously in increasing position, each run
    starting and ending on routing-block boundaries (whole prompt blocks, then whole
    diffusion blocks, a multiple of the routing block), so a row starts a new routing
    block exactly where its position's block differs from the previous row's or its
    position does not increase (the next request)."""
    block = torch.div(positions, routing_block_size, rounding_mode="floor")
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[1:] = (block[1:] != block[:-1]) | (positions[1:] <= positions[:-1])
    return starts.long().cumsum(0) - 1


def block_pool_logits(gating_output: torch.Tensor, blocks: torch.Tensor,
                      expert_bias: torch.Tensor, capacity: int) -> torch.Tensor:
    """LLaDA2.2's block routing, its pool: the router logits [T, E] (fp32) with -inf for
    every expert outside the pool of the token's routing block (``blocks`` [T], from
    ``routing_blocks``): the ``capacity`` experts with the largest block score, the
    maximum over the block's tokens of sigmoid score plus ``expert_bias``. Ties go to the
    lower expert id (as the ports)."""
    logits = gating_output.float()
    biased = torch.sigmoid(logits) + expert_bias.float()  # [T, E]
    tokens, experts = biased.shape
    block_score = torch.full_like(biased, float("-inf")).scatter_reduce(
        0, blocks[:, None].expand(tokens, experts), biased, "amax")  # [T (blocks), E]
    pool = torch.sort(block_score, dim=-1, descending=True, stable=True).indices[:, :capacity]
    in_pool = torch.zeros_like(biased, dtype=torch.bool).scatter_(1, pool, True)
    return logits.masked_fill(~in_pool[blocks], float("-inf"))


def route_in_pool(hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int,
                  renormalize: bool, *, expert_bias: torch.Tensor, scaling: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaDA2.2's block routing, per token: its top-k by biased score among the experts
    its pool allows (finite logits, ``block_pool_logits``; ties: the lower id), weighted
    by their unbiased sigmoid scores renormalised when k > 1, times
    ``routed_scaling_factor``."""
    logits = gating_output.float()
    scores = torch.sigmoid(logits)  # 0 outside the pool
    biased = (scores + expert_bias.float()).masked_fill(logits == float("-inf"),
                                                         float("-inf"))
    ids = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :topk]
    return chosen_weights(scores, ids, scaling)


class LLaDA2Router(nn.Module):
    """``mlp.gate``: the router weight [E, hidden] and ``expert_bias`` [E], both fp32."""

    def __init__(self, config) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size,
                                               dtype=torch.float32), requires_grad=False)
        self.expert_bias = nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32),
                                        requires_grad=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden_states.float(), self.weight.float())


class LLaDA2MoE(nn.Module):
    def __init__(self, config, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        self.capacity = getattr(config, "expert_capacity", 0) or 0
        self.routing_block_size = config.block_size
        if self.capacity:  # LLaDA2.2: n_group / topk_group are ignored
            if not config.num_experts_per_tok <= self.capacity <= config.num_experts:
                raise ValueError(
                    f"expert_capacity {self.capacity} must be between num_experts_per_tok "
                    f"({config.num_experts_per_tok}) and num_experts ({config.num_experts})")
            routing = functools.partial(route_in_pool, scaling=config.routed_scaling_factor)
        elif config.num_experts % config.n_group or config.num_experts // config.n_group < 2:
            raise ValueError(f"{config.num_experts} experts cannot form {config.n_group} "
                             f"groups of at least two (group-limited routing)")
        else:
            routing = functools.partial(route, num_groups=config.n_group,
                                        topk_group=config.topk_group,
                                        scaling=config.routed_scaling_factor)
        self.gate = LLaDA2Router(config)
        self.shared_experts = None
        if config.num_shared_experts:
            self.shared_experts = SwiGLUMLP(
                config.hidden_size, config.moe_intermediate_size * config.num_shared_experts,
                False, vllm_config, f"{prefix}.shared_experts", reduce_results=False)
        self.experts = FusedMoEFactory(
            shared_experts=self.shared_experts, num_experts=config.num_experts,
            top_k=config.num_experts_per_tok, hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size, renormalize=False,
            quant_config=vllm_config.quant_config, prefix=f"{prefix}.experts",
            custom_routing_function=functools.partial(routing,
                                                      expert_bias=self.gate.expert_bias),
            router_logits_dtype=torch.float32)

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(hidden_states)
        if self.capacity:
            router_logits = block_pool_logits(
                router_logits, routing_blocks(positions, self.routing_block_size),
                self.gate.expert_bias, self.capacity)
        return self.experts(hidden_states=hidden_states, router_logits=router_logits)


class LLaDA2DecoderLayer(PreNormHalves, nn.Module):
    attention_name = "attention"

    def __init__(self, config, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        self.layer_index = extract_layer_index(prefix)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention = LLaDA2Attention(config, vllm_config, f"{prefix}.attention")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.num_experts and self.layer_index >= config.first_k_dense_replace:
            self.mlp = LLaDA2MoE(config, vllm_config, f"{prefix}.mlp")
        else:
            self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, False,
                                 vllm_config, f"{prefix}.mlp")

    def feed_forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.mlp, LLaDA2MoE):
            return self.mlp(hidden, positions)
        return self.mlp(hidden)


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1})
class LLaDA2Model(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.word_embeddings")
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: LLaDA2DecoderLayer(config, vllm_config, prefix),
            prefix=f"{prefix}.layers")
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds=None,
                stack_run: StepRun | None = None) -> torch.Tensor:
        return run_layers(self, input_ids, positions, stack_run)


class LLaDA2MoeModelLM(DiffusionCausalLM):
    model_cls = LLaDA2Model
    embedding_name = "word_embeddings"
    hf_to_vllm_mapper = WeightsMapper(orig_to_new_stacked={
        ".mlp.gate_proj": (".mlp.gate_up_proj", 0),
        ".mlp.up_proj": (".mlp.gate_up_proj", 1),
        ".shared_experts.gate_proj": (".shared_experts.gate_up_proj", 0),
        ".shared_experts.up_proj": (".shared_experts.gate_up_proj", 1),
    })
