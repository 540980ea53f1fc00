"""Methods of the diffusion workers callable through ``LLM.collective_rpc(name)``, and the
start-up step they add to vLLM's workers."""

from __future__ import annotations

from vllm_diffusion.worker.warm_up import warm_up_steps


class DiffusionWorkerMethods:
    model_runner: object  # a DiffusionRunnerMixin

    def compile_or_warm_up_model(self):
        # The diffusion steps first (``warm_up.py``; the KV cache is allocated by now),
        # then vLLM's own warm-up, which ends by resetting the random seed.
        warm_up_steps(self.model_runner)
        return super().compile_or_warm_up_model()

    def diffusion_stats(self) -> dict[str, int]:
        """Counters since start-up: steps, positions computed, tokens committed, blocks."""
        return self.model_runner.diffusion_stats_dict()
