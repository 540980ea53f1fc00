"""Committed KV is exact: prefix-cache hits and preemption under KV pressure keep outputs
equal to the reference."""

from __future__ import annotations

import random

from conftest import diffusion_llm, watch_preemptions
from reference_sdar import ReferenceSDAR, reference_generate
from test_parity import checkpoint_info

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

import pytest

pytestmark = pytest.mark.engine

OPTIONS = {"strategy": "low_confidence_dynamic", "threshold": 0.7}


def random_prompt(rng: random.Random, length: int, vocab_size: int, excluded: set[int]) -> list[int]:
    allowed = [t for t in range(vocab_size) if t not in excluded]
    return [rng.choice(allowed) for _ in range(length)]


def test_prefix_cache_hits_reuse_exact_committed_kv(dense_checkpoint):
    block_size, page_size = 4, 16
    mask_id, stops, vocab_size = checkpoint_info(dense_checkpoint)
    rng = random.Random(3)
    shared = random_prompt(rng, 2 * page_size, vocab_size, stops | {mask_id})
    prompts = [shared + random_prompt(rng, n, vocab_size, stops | {mask_id}) for n in (3, 9)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, extra_args=OPTIONS)
    with diffusion_llm(dense_checkpoint, diffusion_block_size=block_size,
                       block_size=page_size, enable_prefix_caching=True) as llm:
        first = llm.generate(TokensPrompt(prompt_token_ids=prompts[0]), params, use_tqdm=False)
        # The second request shares two full pages with the first one's committed KV.
        second = llm.generate(TokensPrompt(prompt_token_ids=prompts[1]), params, use_tqdm=False)
        # A page of generated tokens, committed by the first request, is reused as well.
        third = llm.generate(
            TokensPrompt(prompt_token_ids=prompts[0] + list(first[0].outputs[0].token_ids)[:17]),
            params, use_tqdm=False)
    assert second[0].num_cached_tokens >= 2 * page_size
    assert third[0].num_cached_tokens >= 3 * page_size
    reference = ReferenceSDAR(dense_checkpoint)
    for out in (first[0], second[0], third[0]):
        want = reference_generate(reference, list(out.prompt_token_ids), block_size=block_size,
                                  mask_id=mask_id, max_tokens=20, **OPTIONS)
        assert list(out.outputs[0].token_ids) == want


def test_preemption_under_kv_pressure_keeps_outputs_exact(dense_checkpoint):
    """With room for only a few requests' KV, the scheduler preempts and resumes requests
    (recomputing their committed prefix); outputs stay equal to the reference."""
    block_size, page_size = 4, 16
    mask_id, stops, vocab_size = checkpoint_info(dense_checkpoint)
    rng = random.Random(5)
    prompts = [random_prompt(rng, rng.randint(5, 30), vocab_size, stops | {mask_id})
               for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, extra_args=OPTIONS)
    with diffusion_llm(dense_checkpoint, diffusion_block_size=block_size, block_size=page_size,
                       num_gpu_blocks_override=12, enable_prefix_caching=False,
                       max_model_len=128) as llm:
        preempted = watch_preemptions(llm)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               use_tqdm=False)
    reference = ReferenceSDAR(dense_checkpoint)
    for out in outputs:
        want = reference_generate(reference, list(out.prompt_token_ids), block_size=block_size,
                                  mask_id=mask_id, max_tokens=40, **OPTIONS)
        assert list(out.outputs[0].token_ids) == want
    assert preempted, "no request was preempted; the test does not cover preemption"
