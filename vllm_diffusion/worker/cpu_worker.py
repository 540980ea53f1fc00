"""CPU worker: vLLM's ``CPUWorker`` with the diffusion model runner."""

import torch

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_diffusion.worker.runner import DiffusionRunnerMixin
from vllm_diffusion.worker.worker_methods import DiffusionWorkerMethods


class DiffusionCPUModelRunner(DiffusionRunnerMixin, CPUModelRunner):
    pass


class DiffusionCPUWorker(DiffusionWorkerMethods, CPUWorker):
    def init_device(self) -> None:
        super().init_device()
        # CPUWorker builds its runner inline; replace it before the model is loaded.
        self.model_runner = DiffusionCPUModelRunner(self.vllm_config, torch.device("cpu"))
