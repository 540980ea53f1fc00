"""Marking a vLLM class as wrapped, and telling the plugin's models from others."""

from __future__ import annotations

from typing import Any

from vllm_diffusion.architectures import ARCHITECTURES

_WRAPPED: set[type] = set()  # the vLLM classes whose methods were wrapped


def first_wrap(cls: type) -> bool:
    """True the first time it is asked for ``cls`` (then its methods are to be wrapped)."""
    if cls in _WRAPPED:
        return False
    _WRAPPED.add(cls)
    return True


def serves_diffusion_model(vllm_config: Any) -> bool:
    return is_diffusion_model(getattr(vllm_config, "model_config", None))


def is_diffusion_model(model_config: Any) -> bool:
    return model_config is not None and model_config.architecture in ARCHITECTURES
