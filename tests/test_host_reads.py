"""A denoising step reads the device once: the proposals and their confidences, together.

Counted with ``device_reads.DeviceResident`` (the model's outputs marked as device data)
over whole generations of several requests, greedy and sampled with top-k / top-p, so that
no per-request or per-layer read hides on the step's path. FOCUS and ES-dLLM decide their
evictions and skips on the host (FOCUS reads its importance deltas, then its selection),
so their steps read more than once; they are not held to this here.
"""

from __future__ import annotations

import pytest
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from device_reads import count_device_reads
from vllm_diffusion_lab.offline import diffusion_llm

pytestmark = pytest.mark.engine

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 41)), [30, 31]]


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


@pytest.mark.parametrize("policy", ["standard", "ada", "sparse_prefix"])
def test_one_device_read_per_step(dense_checkpoint, policy):
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=9,
                             ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)]
    with diffusion_llm(dense_checkpoint, diffusion_block_size=4,
                       additional_config={"diffusion_policy": policy}) as llm:
        with count_device_reads(runner_of(llm)) as per_step:
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                                   params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [12, 9, 7, 10]
    assert len(per_step) >= 3
    assert max(len(reads) for reads in per_step) == 1, per_step
