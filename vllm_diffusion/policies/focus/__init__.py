"""FOCUS (``policy.py``), its forward hooks (``hooks.py``), token selection and the
intra-block cache (``selection.py``) and the Triton selection kernel."""

from vllm_diffusion.policies.focus.policy import FocusPolicy, FocusPolicyConfig

__all__ = ["FocusPolicy", "FocusPolicyConfig"]
