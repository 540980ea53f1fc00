"""``--logprobs-mode processed_logprobs``: logprobs read from the distribution each token
was chosen from (its own engine: one engine per test module)."""

from __future__ import annotations

import math

import pytest
from conftest import diffusion_llm

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

pytestmark = pytest.mark.engine


def test_processed_logprobs_see_the_logit_stages(dense_checkpoint):
    """processed_logprobs: the distribution the token was chosen from, so a token pushed
    to the top by logit_bias has logprob about 0 there, and filtered-out tokens of a
    sampled row (top_k=1) are at -inf; raw_logprobs of the same tokens are lower."""
    with diffusion_llm(dense_checkpoint, diffusion_block_size=4, max_model_len=64,
                       logprobs_mode="processed_logprobs") as processed:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1,
                                logit_bias={21: 50.0})
        (out,) = processed.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]), params,
                                    use_tqdm=False)
        got = out.outputs[0]
        assert list(got.token_ids) == [21] * 6
        assert all(e[21].logprob == pytest.approx(0.0, abs=1e-6) for e in got.logprobs)
        (sampled,) = processed.generate(
            TokensPrompt(prompt_token_ids=[5, 6, 7]),
            SamplingParams(temperature=0.7, top_k=1, seed=2, max_tokens=6, ignore_eos=True,
                           logprobs=2), use_tqdm=False)
        for token, entry in zip(sampled.outputs[0].token_ids, sampled.outputs[0].logprobs):
            assert entry[token].logprob == pytest.approx(0.0, abs=1e-6)
            others = [e.logprob for t, e in entry.items() if t != token]
            assert others and all(math.isinf(v) or v <= -9999 for v in others)
