"""Dream (``DreamModel``, ``model_type: Dream``; Dream-v0-Base/Instruct-7B): Qwen2.5's
weights run as a masked-diffusion model whose every position attends to every other.

The published ``modeling_dream.py`` is Qwen2 with the causal mask removed
(``qwen2_layers.py``: biases on q/k/v, none on ``o_proj``, no q/k norm, rotate-half RoPE,
SwiGLU MLP, pre-norm RMSNorm layers), the LM head tied to the embedding where
``tie_word_embeddings``. The weight names are Qwen2's (``model.layers...``, ``lm_head``),
so vLLM's Qwen2 model loads them.

Its logits are shifted: position j's token is predicted by row j - 1 (Dream is initialised
from an autoregressive model). The model computes each row's logits as they are; the
shift is declared in the family's capabilities (``shifted_logits``) for the engine.
"""

from __future__ import annotations

from vllm_diffusion.models.qwen2_layers import Qwen2DiffusionForCausalLM


class DreamModel(Qwen2DiffusionForCausalLM):
    """Dream's checkpoint class (``architectures: [DreamModel]``): Qwen2's model, LM head
    and per-row logits."""
