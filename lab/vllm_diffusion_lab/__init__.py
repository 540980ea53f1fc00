"""The lab around vllm-diffusion: what measures and tests the serving package but is not
shipped with it.

``quality`` (task corpus, retrieval prompts, quality harness), ``fixtures`` (tiny seeded
checkpoints, a loopback ``vllm serve``), ``offline`` (an in-process ``vllm.LLM`` and its
counters), ``recording`` (the decodability study's importance recorder), ``bench`` (helpers
the benchmarks share) and ``training`` (what the training tools share). Installed in
editable mode by ``tools/setup_env.sh``.
"""
