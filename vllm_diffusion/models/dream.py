"""Dream (``DreamModel``, ``model_type: Dream``; Dream-v0-Base/Instruct-7B): Qwen2.5's
weights (``qwen2_layers.py``: the published ``modeling_dream.py`` is Qwen2 without the
causal mask) run as a full-attention masked-diffusion model. Its logits are shifted
(position j from row j - 1), which its capabilities declare for the engine.
"""

from __future__ import annotations

from vllm_diffusion.models.qwen2_layers import Qwen2DiffusionForCausalLM


class DreamModel(Qwen2DiffusionForCausalLM):
    """Dream's checkpoint class (``architectures: [DreamModel]``): Qwen2's model, LM head
    and per-row logits."""
