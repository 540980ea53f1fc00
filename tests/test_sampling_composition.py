"""The sampling surface composed with every policy: logprobs, bad_words, logit_bias,
allowed_token_ids, min_tokens and a grammar in one batch, with n = 2 sampled choices,
under each decoding policy (one engine per policy, a 4-layer model so that every policy's
hook layers exist)."""

from __future__ import annotations

import re

import pytest
from conftest import diffusion_llm
from test_logprobs_bad_words import letters

from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import StructuredOutputsParams

from vllm_diffusion_lab.fixtures.tiny_sdar import build_tiny_sdar

pytestmark = pytest.mark.engine

BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_sdar(tmp_path_factory.mktemp("sdar-4-layers"), num_layers=4, seed=3)


@pytest.mark.parametrize("policy", ["standard", "focus", "elastic", "es", "ada",
                                    "sparse_prefix"])
def test_every_parameter_holds_under_every_policy(policy, checkpoint):
    with diffusion_llm(checkpoint, diffusion_block_size=BLOCK_SIZE, max_model_len=128,
                       additional_config={"diffusion_policy": policy}) as llm:
        first, second = letters(llm, 2)
        tok = llm.get_tokenizer()
        stop = tok.eos_token_id
        allowed = [11, 12, 13, stop]
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=[5, 6, 7]),
             TokensPrompt(prompt_token_ids=[8, 9, 10, 11, 12, 13, 14, 15, 16, 17]),
             TokensPrompt(prompt_token_ids=[20, 21]),
             TokensPrompt(prompt_token_ids=[30, 31, 32, 33, 34])],
            [SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=16, ignore_eos=True,
                            logprobs=2, logit_bias={first: 100.0, second: 80.0},
                            bad_words=[tok.decode([first]) * 2]),
             SamplingParams(temperature=0, max_tokens=16, min_tokens=6,
                            allowed_token_ids=allowed, logit_bias={stop: 100.0},
                            logprobs=0),
             SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                            repetition_penalty=1.3, presence_penalty=0.5),
             SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(
                                regex="[a-d]{4}( [a-d]{2,3}){2,4}"))],
            use_tqdm=False)
        for choice in outputs[0].outputs:
            tokens = list(choice.token_ids)
            assert len(tokens) == 16 and set(tokens) <= {first, second}, tokens
            assert first in tokens
            assert all(pair != (first, first) for pair in zip(tokens, tokens[1:]))
            assert len(choice.logprobs) == 16
            assert all(t in e and len(e) >= 2 for t, e in zip(tokens, choice.logprobs))
        bounded = outputs[1].outputs[0]
        assert list(bounded.token_ids)[-1] == stop and len(bounded.token_ids) == 7
        assert set(bounded.token_ids[:6]) <= {11, 12, 13}
        assert [list(e) for e in bounded.logprobs] == [[t] for t in bounded.token_ids]
        assert len(outputs[2].outputs[0].token_ids) == 10
        for choice in outputs[3].outputs:
            assert choice.finish_reason == "stop"
            assert re.fullmatch("[a-d]{4}( [a-d]{2,3}){2,4}", choice.text), choice.text
