"""Optimus's elastic chunking (``policy.py``), its chunk statistics and latency model."""

from vllm_diffusion.policies.elastic.policy import ElasticConfig, ElasticPolicy

__all__ = ["ElasticConfig", "ElasticPolicy"]
