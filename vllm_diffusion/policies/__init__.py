"""Decoding policies, one module (or small package) each, behind ``base.DecodingPolicy``.

``POLICIES`` maps a policy name to its class; adding a policy is one module plus one entry
here.
"""

from vllm_diffusion.policies.adaptive_freeze import AdaptiveFreezePolicy
from vllm_diffusion.policies.base import DecodingPolicy
from vllm_diffusion.policies.early_skip import EarlySkipPolicy
from vllm_diffusion.policies.elastic import ElasticPolicy
from vllm_diffusion.policies.focus import FocusPolicy
from vllm_diffusion.policies.sparse_prefix import SparsePrefixPolicy
from vllm_diffusion.policies.standard import StandardPolicy

POLICIES: dict[str, type[DecodingPolicy]] = {
    cls.name: cls for cls in (StandardPolicy, FocusPolicy, ElasticPolicy, EarlySkipPolicy,
                              AdaptiveFreezePolicy, SparsePrefixPolicy)}

__all__ = ["POLICIES", "DecodingPolicy"]
