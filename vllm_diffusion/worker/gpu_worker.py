"""CUDA worker: vLLM's GPU ``Worker`` with the diffusion model runner (V1 runner)."""

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from vllm_diffusion.worker.runner import DiffusionRunnerMixin
from vllm_diffusion.worker.worker_methods import DiffusionWorkerMethods


class DiffusionGPUModelRunner(DiffusionRunnerMixin, GPUModelRunner):
    pass


class DiffusionGPUWorker(DiffusionWorkerMethods, Worker):
    def _make_model_runner(self) -> GPUModelRunner:
        return DiffusionGPUModelRunner(self.vllm_config, self.device)
