"""Hugging Face configuration classes for SDAR checkpoints.

SDAR is Qwen3 (and SDAR-MoE is Qwen3-MoE) with a block-diffusion mask and a mask token;
registering these lets ``model_type: sdar`` / ``sdar_moe`` load without remote code.
"""

from transformers import Qwen3Config, Qwen3MoeConfig


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


def register_hf_configs() -> None:
    from transformers import AutoConfig

    AutoConfig.register(SDARConfig.model_type, SDARConfig, exist_ok=True)
    AutoConfig.register(SDARMoeConfig.model_type, SDARMoeConfig, exist_ok=True)
