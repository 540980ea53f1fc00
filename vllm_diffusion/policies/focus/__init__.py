"""FOCUS (``policy.py``) and its forward hooks (``hooks.py``); its selection and importance
kernels are in ``kernels/``."""

from vllm_diffusion.policies.focus.policy import FocusConfig, FocusPolicy

__all__ = ["FocusConfig", "FocusPolicy"]
