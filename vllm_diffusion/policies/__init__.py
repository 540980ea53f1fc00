"""Decoding policies, one small module each. ``POLICIES`` maps a policy name to its class."""

from vllm_diffusion.policies.focus import FocusPolicy
from vllm_diffusion.policies.standard import StandardPolicy

POLICIES = {cls.name: cls for cls in (StandardPolicy, FocusPolicy)}

__all__ = ["POLICIES", "FocusPolicy", "StandardPolicy"]
