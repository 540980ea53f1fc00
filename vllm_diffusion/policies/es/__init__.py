"""ES-dLLM (``policy.py``: the policy, its options and forward hooks) and its per-request
state and decision (``state.py``)."""

from vllm_diffusion.policies.es.policy import EsConfig, EsPolicy, default_skip_layers, keep_count

__all__ = ["EsConfig", "EsPolicy", "default_skip_layers", "keep_count"]
