"""Hugging Face configuration of Fast-dLLM v2 (``model_type: Fast_dLLM_Qwen``;
``Efficient-Large-Model/Fast_dLLM_v2_7B`` and ``_1.5B``), and its capabilities: Qwen2's
configuration plus ``bd_size`` (the diffusion block). The mask and stop tokens are not
configuration keys but arguments of the published ``generate`` (``mask_id=151665``,
``stop_token=151645``): the mask id is the default here, the stop tokens come from the
checkpoint's ``generation_config.json`` as for every family.
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen2Config

from vllm_diffusion.capabilities import ModelCapabilities

# the published ``generate``'s ``mask_id`` default
PUBLISHED_MASK_ID = 151665


class FastDLLMQwenConfig(Qwen2Config):
    """Qwen2's configuration under ``model_type: Fast_dLLM_Qwen`` with ``bd_size`` (the
    published 32 unless the checkpoint names one), read by the engine as ``block_size``."""

    model_type = "Fast_dLLM_Qwen"

    def __init__(self, bd_size: int = 32, mask_token_id: int | None = PUBLISHED_MASK_ID,
                 **kwargs):
        self.bd_size = bd_size
        self.mask_token_id = mask_token_id
        super().__init__(**kwargs)

    @property
    def block_size(self) -> int:
        return self.bd_size


# The published loop's settings (``v2/run_chatbot.py``: ``small_block_size=8``,
# ``threshold=0.9``): the most confident masked position of the active sub-block and every
# one above the threshold.
FAST_DLLM_V2_DECODING = {"strategy": "threshold", "threshold": 0.9, "sub_block_size": 8}


def fast_dllm_v2_capabilities(config: Any) -> ModelCapabilities:
    """Fast-dLLM v2: block-causal attention, logits shifted by one row."""
    return ModelCapabilities(family="Fast-dLLM v2", shifted_logits=True,
                             option_defaults=FAST_DLLM_V2_DECODING)
