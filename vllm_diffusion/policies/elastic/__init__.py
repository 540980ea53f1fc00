"""Optimus's elastic chunking (``policy.py``), the chunk statistics it chooses by
(``chunk_statistics.py``) and its latency model (``latency_model.py``)."""

from vllm_diffusion.policies.elastic.policy import ElasticConfig, ElasticPolicy

__all__ = ["ElasticConfig", "ElasticPolicy"]
