"""The decode trace: on request, the denoising step that unmasked each output token."""

from __future__ import annotations

import pytest
from conftest import diffusion_llm
from reference_sdar import ReferenceSDAR, reference_generate_trace
from test_parity import checkpoint_info, make_prompts

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt

pytestmark = pytest.mark.engine

BLOCK_SIZE = 8
STEP_MAP = "diffusion_step_map"


@pytest.fixture(scope="module")
def llm(dense_checkpoint):
    with diffusion_llm(dense_checkpoint, diffusion_block_size=BLOCK_SIZE) as engine:
        yield engine


@pytest.mark.parametrize("strategy", ["low_confidence_dynamic", "sequential", "threshold"])
def test_step_map_matches_the_reference_loop(llm, dense_checkpoint, strategy):
    mask_id, stops, vocab_size = checkpoint_info(dense_checkpoint)
    reference = ReferenceSDAR(dense_checkpoint)
    prompts = make_prompts(BLOCK_SIZE, vocab_size, stops | {mask_id}, seed=3)
    options = {"strategy": strategy, "threshold": 0.6}
    params = SamplingParams(temperature=0, max_tokens=3 * BLOCK_SIZE + 2,
                            extra_args={**options, "return_step_map": True})
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                           use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        want = reference_generate_trace(reference, prompt, block_size=BLOCK_SIZE, mask_id=mask_id,
                                        max_tokens=params.max_tokens, stop_token_ids=stops,
                                        **options)
        assert list(out.outputs[0].token_ids) == want.output_ids
        assert out.kv_transfer_params[STEP_MAP] == want.step_map
    # The map is non-decreasing across blocks and spans several steps per block.
    steps = outputs[-1].kv_transfer_params[STEP_MAP]
    assert len(set(steps)) > len(steps) // BLOCK_SIZE


def test_step_map_only_when_asked(llm):
    out = llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]),
                       SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert not (out.kv_transfer_params or {}).get(STEP_MAP)


def test_step_map_is_cut_with_the_output_at_a_stop_string(llm):
    # Threshold 0 unmasks a whole block per step: the stop string falls inside a step's
    # tokens, whose surplus the detokenizer drops.
    params = SamplingParams(temperature=0, max_tokens=3 * BLOCK_SIZE, ignore_eos=True,
                            extra_args={"strategy": "threshold", "threshold": 0.0,
                                        "return_step_map": True})
    free = llm.generate(TokensPrompt(prompt_token_ids=[9, 10, 11]), params, use_tqdm=False)[0]
    text = free.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), "the free run's text is too short for a stop string"
    params.stop = [stop]
    out = llm.generate(TokensPrompt(prompt_token_ids=[9, 10, 11]), params, use_tqdm=False)[0]
    tokens = list(out.outputs[0].token_ids)
    assert out.outputs[0].finish_reason == "stop" and len(tokens) < len(free.outputs[0].token_ids)
    prompt_len = 3
    assert (prompt_len + len(tokens)) % BLOCK_SIZE, "the stop fell on a block boundary"
    assert out.kv_transfer_params[STEP_MAP] == free.kv_transfer_params[STEP_MAP][:len(tokens)]


def test_step_map_flag_is_validated(llm):
    with pytest.raises((ValueError, VLLMValidationError),
                       match=r"option 'return_step_map' must be bool, got 'maybe'"):
        llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]),
                     SamplingParams(max_tokens=4, extra_args={"return_step_map": "maybe"}),
                     use_tqdm=False)
