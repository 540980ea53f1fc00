"""Decoding policies, one module (or small package) each, behind ``base.DecodingPolicy``.

``POLICIES`` maps a policy name (what users type) to its class; the module of a policy is
named after it. Adding a policy is one module plus one entry here.
"""

from vllm_diffusion.policies.ada import AdaPolicy
from vllm_diffusion.policies.base import DecodingPolicy
from vllm_diffusion.policies.elastic import ElasticPolicy
from vllm_diffusion.policies.es import EsPolicy
from vllm_diffusion.policies.focus import FocusPolicy
from vllm_diffusion.policies.sparse_prefix import SparsePrefixPolicy
from vllm_diffusion.policies.standard import StandardPolicy

POLICIES: dict[str, type[DecodingPolicy]] = {
    cls.name: cls for cls in (StandardPolicy, FocusPolicy, ElasticPolicy, EsPolicy,
                              AdaPolicy, SparsePrefixPolicy)}

__all__ = ["POLICIES", "DecodingPolicy"]
