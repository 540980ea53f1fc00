"""Methods of the diffusion workers callable through ``LLM.collective_rpc(name)``."""

from __future__ import annotations


class DiffusionWorkerMethods:
    model_runner: object  # a DiffusionRunnerMixin

    def diffusion_stats(self) -> dict[str, int]:
        """Counters since start-up: steps, positions computed, tokens committed, blocks."""
        return self.model_runner.diffusion_stats_dict()
