"""Fast-dLLM v2 (``Fast_dLLM_QwenForCausalLM``, ``model_type: Fast_dLLM_Qwen``;
``Efficient-Large-Model/Fast_dLLM_v2_7B`` and ``_1.5B``): Qwen2.5's weights run as a
block-diffusion model.

The published ``modeling.py`` at inference is Qwen2's layers verbatim (biases on q/k/v,
none on ``o_proj``, no q/k norm, rotate-half RoPE, SwiGLU, pre-norm RMSNorm, ``lm_head``
tied where the config says) under block-causal attention (``eval_block_diff_mask``: a
position sees every position of its own block and of earlier blocks), with Qwen2's weight
names; its split-RoPE path is for training only. The layers are ``qwen2_layers.py``'s (as
Dream's); the attention regime is the engine's, from the family's capabilities
(``fast_dllm_v2_config.py``), which also declare its shifted logits.
"""

from __future__ import annotations

from vllm_diffusion.models.qwen2_layers import Qwen2DiffusionForCausalLM


class Fast_dLLM_QwenForCausalLM(Qwen2DiffusionForCausalLM):
    """Fast-dLLM v2's checkpoint class: Qwen2's model, LM head and per-row logits."""
