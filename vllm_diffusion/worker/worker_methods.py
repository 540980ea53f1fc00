"""Methods of the diffusion workers callable through ``LLM.collective_rpc(name)``."""

from __future__ import annotations


class DiffusionWorkerMethods:
    model_runner: object  # a DiffusionRunnerMixin

    def diffusion_stats(self) -> dict[str, int]:
        """Counters since start-up: steps, positions computed, tokens committed, blocks."""
        return self.model_runner.diffusion_stats_dict()

    def start_importance_recording(self) -> None:
        """Record FOCUS importance (layers 0/1) of masked positions at every step."""
        from vllm_diffusion.worker.importance_recording import ImportanceRecorder

        runner = self.model_runner
        runner.importance_recorder = ImportanceRecorder(runner.diffusion.mask_token_id)

    def take_importance_records(self) -> list[dict[str, list]]:
        """The records since start_importance_recording(); recording stops."""
        recorder, self.model_runner.importance_recorder = (
            self.model_runner.importance_recorder, None)
        return recorder.records if recorder is not None else []
