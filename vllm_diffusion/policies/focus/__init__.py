"""FOCUS (``policy.py``) and its forward hooks (``hooks.py``); its kernels are in ``kernels/``."""

from vllm_diffusion.policies.focus.policy import FocusConfig, FocusPolicy

__all__ = ["FocusConfig", "FocusPolicy"]
