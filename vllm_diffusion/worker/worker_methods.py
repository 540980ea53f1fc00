"""Methods of the diffusion workers callable through ``LLM.collective_rpc(name)``."""

from __future__ import annotations


class DiffusionWorkerMethods:
    model_runner: object  # a DiffusionRunnerMixin

    def diffusion_stats(self) -> dict[str, int]:
        """Counters since start-up: steps, positions computed, tokens committed, blocks."""
        return self.model_runner.diffusion_stats_dict()

    def start_importance_recording(self) -> None:
        """Record FOCUS importance (layers 0/1) of masked positions at every step."""
        self.model_runner.importance_records = []

    def take_importance_records(self) -> list[dict[str, list]]:
        """The records since start_importance_recording(); recording stops."""
        records, self.model_runner.importance_records = self.model_runner.importance_records, None
        return records or []
