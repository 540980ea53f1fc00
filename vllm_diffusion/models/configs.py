"""Hugging Face configuration classes for SDAR (Qwen3 / Qwen3-MoE with a block-diffusion
mask and a mask token) and LLaDA2 (Ling-2.0) checkpoints, and the registry of every
family's configuration and capabilities, so that every family's ``model_type`` loads
without remote code.
"""

import dataclasses
from typing import Any

from transformers import PretrainedConfig, Qwen3Config, Qwen3MoeConfig

from vllm_diffusion.capabilities import ModelCapabilities
from vllm_diffusion.models.fast_dllm_v2_config import (FastDLLMQwenConfig,
                                                       fast_dllm_v2_capabilities)
from vllm_diffusion.models.full_attention_configs import (FULL_ATTENTION_CAPABILITIES,
                                                          DreamConfig, LLaDAConfig)


class SDARConfig(Qwen3Config):
    model_type = "sdar"

    def __init__(self, block_size: int | None = None, mask_token_id: int | None = None,
                 **kwargs):
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        super().__init__(**kwargs)


class SDARMoeConfig(Qwen3MoeConfig):
    model_type = "sdar_moe"

    def __init__(self, block_size: int | None = None, mask_token_id: int | None = None,
                 num_experts: int | None = None, **kwargs):
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        if num_experts is not None:  # SDAR checkpoints use the transformers 4.x name
            kwargs.setdefault("num_local_experts", num_experts)
        super().__init__(**kwargs)

    @property
    def num_experts(self) -> int:
        return self.num_local_experts


class LLaDA2MoeConfig(PretrainedConfig):
    """The published ``configuration_llada2_moe.py`` fields and defaults (``use_qk_norm``
    True: the published forward always normalises q/k), the router fields its checkpoints
    carry as extra keys, and ``block_size`` (the published 32) and ``mask_token_id`` (None:
    real checkpoints carry neither; the tokenizer's ``<|mask|>`` is used) unless named."""

    model_type = "llada2_moe"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size=30592, hidden_size=1024, intermediate_size=None,
                 num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=0,
                 hidden_act="silu", use_qkv_bias=False, use_qk_norm=True, use_bias=True,
                 rms_norm_eps=1e-05, norm_head=False, tie_word_embeddings=False,
                 embedding_dropout=0.1, attention_dropout=0.1, output_dropout=0.1,
                 initializer_range=0.02, max_position_embeddings=16384, rope_theta=10000.0,
                 use_cache=True, use_sliding_window=False, sliding_window=4096,
                 max_window_layers=28, rope_scaling=None, pad_token_id=126081, num_experts=16,
                 num_shared_experts=0, num_experts_per_tok=2, n_group=8, topk_group=4,
                 routed_scaling_factor=2.5, moe_intermediate_size=None,
                 first_k_dense_replace=0, head_dim=None, output_router_logits=False,
                 partial_rotary_factor=0.5, rotary_dim=None, norm_topk_prob=True,
                 score_function="sigmoid", router_dtype="fp32",
                 moe_router_enable_expert_bias=True, block_size=32, mask_token_id=None,
                 expert_capacity=0, delete_token_id=None, split_token_id=None,
                 **kwargs):
        # every published field keeps its name (``rotary_dim`` is ignored by the published
        # forward); LLaDA2.2: block routing (per routing block of ``block_size`` tokens, the
        # best ``expert_capacity`` experts form the pool each token picks from) when > 0, and
        # the edit tokens of its joint decoding
        given = locals()
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "hidden_act",
                     "use_qkv_bias", "use_qk_norm", "use_bias", "rms_norm_eps", "norm_head",
                     "embedding_dropout", "attention_dropout", "output_dropout",
                     "initializer_range", "max_position_embeddings", "rope_theta",
                     "use_cache", "use_sliding_window", "max_window_layers", "rope_scaling",
                     "num_experts", "num_shared_experts", "num_experts_per_tok", "n_group",
                     "topk_group", "routed_scaling_factor", "moe_intermediate_size",
                     "first_k_dense_replace", "output_router_logits", "partial_rotary_factor",
                     "rotary_dim", "norm_topk_prob", "score_function", "router_dtype",
                     "moe_router_enable_expert_bias", "block_size", "mask_token_id",
                     "expert_capacity", "delete_token_id", "split_token_id"):
            setattr(self, name, given[name])
        # Off unless enabled, as Qwen2's config does (vLLM reads ``sliding_window``).
        self.sliding_window = sliding_window if use_sliding_window else None
        self.head_dim = head_dim or hidden_size // num_attention_heads
        super().__init__(pad_token_id=pad_token_id, tie_word_embeddings=tie_word_embeddings,
                         **kwargs)


# LLaDA2.2's published generation settings where they differ from the engine's defaults
# (its quota schedule, post steps and step cap are the engine's own defaults).
LLADA22_DECODING = {"threshold": 0.5, "editing_threshold": 0.0,
                    "strategy": "low_confidence_dynamic"}


def _llada2_capabilities(config: Any) -> ModelCapabilities:
    """LLaDA2.0 / 2.1: block diffusion on fixed positions. LLaDA2.2
    (``expert_capacity > 0``): experts routed per block of ``block_size`` tokens, and
    DELETE / SPLIT edits that move tokens (their ids checked here)."""
    if not (getattr(config, "expert_capacity", 0) or 0):
        return ModelCapabilities(family="LLaDA2")
    ids = []
    for name in ("delete_token_id", "split_token_id"):
        value = getattr(config, name, None)
        if not isinstance(value, int) or not 0 <= value < config.vocab_size:
            raise ValueError(f"a LLaDA2.2 checkpoint (expert_capacity > 0) needs "
                             f"config.json '{name}' in [0, {config.vocab_size}), got "
                             f"{value!r}")
        ids.append(value)
    if ids[0] == ids[1]:
        raise ValueError(f"delete_token_id and split_token_id must differ, both {ids[0]}")
    return ModelCapabilities(family="LLaDA2.2", edit_tokens=(ids[0], ids[1]),
                             routing_block_size=config.block_size,
                             option_defaults=LLADA22_DECODING)


# model_type -> what serving the family needs, from its configuration
FAMILY_CAPABILITIES = {
    SDARConfig.model_type: lambda config: ModelCapabilities(family="SDAR"),
    SDARMoeConfig.model_type: lambda config: ModelCapabilities(family="SDAR-MoE"),
    LLaDA2MoeConfig.model_type: _llada2_capabilities,
    FastDLLMQwenConfig.model_type: fast_dllm_v2_capabilities,
    **FULL_ATTENTION_CAPABILITIES,
}


# config.json key: unmasking option defaults tuned for these weights, e.g.
# {"threshold": 0.7} (checked against the options where the engine's options are parsed)
CHECKPOINT_DEFAULTS_KEY = "diffusion_option_defaults"


def model_capabilities(hf_config: Any) -> ModelCapabilities:
    """The served model's capabilities, as its family declares them, with the checkpoint's
    own option defaults over the family's; raises ``ValueError`` where the checkpoint's
    configuration contradicts them."""
    model_type = getattr(hf_config, "model_type", None)
    declare = FAMILY_CAPABILITIES.get(model_type)
    if declare is None:
        raise ValueError(f"vllm-diffusion has no model family for model_type "
                         f"{model_type!r}; known: {', '.join(sorted(FAMILY_CAPABILITIES))}")
    capabilities = declare(hf_config)
    tuned = getattr(hf_config, CHECKPOINT_DEFAULTS_KEY, None)
    if tuned is None:
        return capabilities
    if not isinstance(tuned, dict) or not all(isinstance(k, str) for k in tuned):
        raise ValueError(f"config.json '{CHECKPOINT_DEFAULTS_KEY}' must map option names "
                         f"to values, got {tuned!r}")
    return dataclasses.replace(capabilities, checkpoint_option_defaults=dict(tuned))


def register_hf_configs() -> None:
    from transformers import AutoConfig

    AutoConfig.register(SDARConfig.model_type, SDARConfig, exist_ok=True)
    AutoConfig.register(SDARMoeConfig.model_type, SDARMoeConfig, exist_ok=True)
    AutoConfig.register(LLaDA2MoeConfig.model_type, LLaDA2MoeConfig, exist_ok=True)
    AutoConfig.register(LLaDAConfig.model_type, LLaDAConfig, exist_ok=True)
    AutoConfig.register(DreamConfig.model_type, DreamConfig, exist_ok=True)
    AutoConfig.register(FastDLLMQwenConfig.model_type, FastDLLMQwenConfig, exist_ok=True)
