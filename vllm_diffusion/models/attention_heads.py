"""Attention head setup shared by every model family: this rank's head counts and sizes
and the block-diffusion attention layer (``attention.backend``)."""

from __future__ import annotations

import torch.nn as nn

from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention

from vllm_diffusion.attention.backend import BlockDiffusionAttentionBackend


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
