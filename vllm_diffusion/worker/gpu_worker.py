"""CUDA worker: vLLM's GPU ``Worker`` with the diffusion model runner (V1 runner)."""

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from vllm_diffusion.worker.runner import DiffusionRunnerMixin


class DiffusionGPUModelRunner(DiffusionRunnerMixin, GPUModelRunner):
    pass


class DiffusionGPUWorker(Worker):
    def _make_model_runner(self) -> GPUModelRunner:
        return DiffusionGPUModelRunner(self.vllm_config, self.device)

    def diffusion_stats(self) -> dict[str, int]:
        return self.model_runner.diffusion_stats_dict()
