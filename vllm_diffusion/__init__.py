"""vllm-diffusion: serve block-diffusion language models with vLLM.

``register()`` is vLLM's general-plugin entry point, called in every process: idempotent
and cheap (models are registered by import path).
"""

__version__ = "0.1.0"

from vllm_diffusion.architectures import ARCHITECTURES

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True

    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from vllm_diffusion.engine_setup import DiffusionModelConfigHook
    from vllm_diffusion.models.configs import register_hf_configs
    from vllm_diffusion.seams import install as install_seams

    register_hf_configs()
    for arch, path in ARCHITECTURES.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, path)
        MODELS_CONFIG_MAP[arch] = DiffusionModelConfigHook
    install_seams()
