"""ES-dLLM (``policy.py``: the policy, options and hooks; ``state.py``: its state)."""

from vllm_diffusion.policies.es.policy import EsConfig, EsPolicy, default_skip_layers, keep_count

__all__ = ["EsConfig", "EsPolicy", "default_skip_layers", "keep_count"]
