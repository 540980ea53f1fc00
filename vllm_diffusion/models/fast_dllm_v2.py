"""Fast-dLLM v2 (``Fast_dLLM_QwenForCausalLM``, ``model_type: Fast_dLLM_Qwen``): Qwen2.5's
weights run as a block-diffusion model. The published ``modeling.py`` at inference is
Qwen2's layers verbatim (``qwen2_layers.py``) under block-causal attention; the attention
regime and its shifted logits are declared in ``fast_dllm_v2_config.py``.
"""

from __future__ import annotations

from vllm_diffusion.models.qwen2_layers import Qwen2DiffusionForCausalLM


class Fast_dLLM_QwenForCausalLM(Qwen2DiffusionForCausalLM):
    """Fast-dLLM v2's checkpoint class: Qwen2's model, LM head and per-row logits."""
