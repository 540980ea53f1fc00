"""Bounded logits memory: a step's logits are made a chunk of whole requests at a time
within ``diffusion_logits_memory_mib``, and vLLM's start-up profiling run makes the
largest such chunk (not vLLM's one row per request), so the peak it measures covers a
step's logits. (Chunked proposals equal whole-step ones: ``test_sampling.py``.)"""

from __future__ import annotations

import pytest
import torch
from conftest import diffusion_llm

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from vllm_diffusion.worker.proposal import chunk_rows

pytestmark = pytest.mark.engine


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def test_profiling_makes_the_largest_logits_chunk_and_steps_stay_within_it(dense_checkpoint):
    block, requests = 8, 64
    with diffusion_llm(dense_checkpoint, diffusion_block_size=block, max_num_seqs=requests,
                       additional_config={"diffusion_logits_memory_mib": 1}) as llm:
        runner = runner_of(llm)
        vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
        budget_rows = chunk_rows(1, vocab)
        assert budget_rows < requests * block  # the budget really cuts a full step
        want = min(requests, budget_rows // block) * block
        seen = []
        compute_logits = runner.model.compute_logits

        def counting(hidden):
            seen.append(hidden.shape[0])
            return compute_logits(hidden)

        runner.model.compute_logits = counting
        try:
            hidden_size = llm.llm_engine.vllm_config.model_config.get_hidden_size()
            tokens = runner._dummy_sampler_run(torch.zeros(requests, hidden_size))
            assert seen == [want] and len(tokens) == want
            seen.clear()
            outputs = llm.generate(
                [TokensPrompt(prompt_token_ids=[5 + i % 7, 6, 7]) for i in range(requests)],
                SamplingParams(temperature=0, max_tokens=2 * block, ignore_eos=True),
                use_tqdm=False)
        finally:
            del runner.model.compute_logits
    assert all(len(o.outputs[0].token_ids) == 2 * block for o in outputs)
    assert max(seen) <= budget_rows and sum(seen) >= requests * block
