"""SDAR models: Qwen3 / Qwen3-MoE weights and layers with block-diffusion attention.

SDAR's architecture is Qwen3 verbatim (weights, names, q/k-norm before RoPE); only the
attention mask and the decoding loop differ. The models are vLLM's own Qwen3 classes
(tensor parallelism and weight loading as in vLLM) whose attention layers are rebuilt on
``BlockDiffusionAttentionBackend``, with the hooks FOCUS eviction uses (inactive unless a
step evicts).
"""

from __future__ import annotations

import torch.nn as nn

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

from vllm_diffusion.attention.backend import BlockDiffusionAttentionBackend
from vllm_diffusion.attention.eviction import install_eviction_hooks


def use_block_diffusion_attention(model: nn.Module, vllm_config: VllmConfig) -> None:
    """Rebuild every ``Attention`` layer of ``model`` on the block-diffusion backend.

    The new layer keeps the old one's name, heads and scale; the old one is removed from
    vLLM's forward context first so the name can be registered again.
    """
    forward_context = get_current_vllm_config().compilation_config.static_forward_context
    owners = [m for m in model.modules() if isinstance(getattr(m, "attn", None), Attention)]
    for owner in owners:
        old = owner.attn
        del forward_context[old.layer_name]
        owner.attn = Attention(
            old.num_heads, old.head_size, old.impl.scale,
            num_kv_heads=old.num_kv_heads,
            cache_config=vllm_config.cache_config,
            quant_config=vllm_config.quant_config,
            prefix=old.layer_name,
            attn_backend=BlockDiffusionAttentionBackend,
        )
    if not owners:
        raise RuntimeError(f"{type(model).__name__} has no attention layer to convert")


class SDARForCausalLM(Qwen3ForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        use_block_diffusion_attention(self, vllm_config)
        install_eviction_hooks(self.model.layers)


class SDARMoeForCausalLM(Qwen3MoeForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        use_block_diffusion_attention(self, vllm_config)
        install_eviction_hooks(self.model.layers)
