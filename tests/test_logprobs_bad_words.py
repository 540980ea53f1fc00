"""``logprobs`` (the log-probability of each returned token at the denoising step that
committed it) and ``bad_words`` (no word ever completed by the committed output) through
the offline engine, against the reference loop (the matching itself:
``test_bad_words.py``)."""

from __future__ import annotations

import pytest
from conftest import diffusion_llm
from reference_sdar import ReferenceSDAR, reference_generate_trace
from test_parity import checkpoint_info, make_prompts

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt

pytestmark = pytest.mark.engine

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def llm(dense_checkpoint):
    with diffusion_llm(dense_checkpoint, diffusion_block_size=BLOCK_SIZE,
                       max_model_len=128) as engine:
        yield engine


def letters(llm, count: int) -> list[int]:
    """Single-letter tokens whose doubled string tokenizes to the token twice."""
    tok = llm.get_tokenizer()
    found = []
    for token in range(len(tok)):
        text = tok.decode([token])
        if (len(text) == 1 and text.isalpha()
                and tok.encode(text * 2, add_special_tokens=False) == [token, token]):
            found.append(token)
        if len(found) == count:
            return found
    pytest.skip("the tiny tokenizer has too few single-letter tokens")


def test_greedy_logprobs_equal_the_reference_loop(llm, dense_checkpoint):
    """raw_logprobs (vLLM's default mode): each token's logprob and top-2 are those of the
    model's logits at the step that unmasked it, in the reference loop; the cumulative
    logprob is their sum."""
    mask_id, stops, vocab_size = checkpoint_info(dense_checkpoint)
    reference = ReferenceSDAR(dense_checkpoint)
    prompts = make_prompts(BLOCK_SIZE, vocab_size, stops | {mask_id}, seed=7)
    params = SamplingParams(temperature=0, max_tokens=3 * BLOCK_SIZE + 1, logprobs=2,
                            extra_args={"threshold": 0.5})
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                           use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        want = reference_generate_trace(reference, prompt, block_size=BLOCK_SIZE,
                                        mask_id=mask_id, max_tokens=params.max_tokens,
                                        stop_token_ids=stops, threshold=0.5)
        got = out.outputs[0]
        assert list(got.token_ids) == want.output_ids
        assert len(got.logprobs) == len(got.token_ids)
        for token, entry, logprob, top2 in zip(got.token_ids, got.logprobs, want.logprobs,
                                               want.top2):
            assert entry[token].logprob == pytest.approx(logprob, abs=1e-4)
            assert set(top2) <= set(entry) and entry[top2[0]].rank == 1
            assert entry[token].rank >= 1
        assert got.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(got.token_ids, got.logprobs)), abs=1e-4)


def test_logprobs_in_mixed_batches_with_n_and_their_validation(llm):
    """Requests with and without logprobs, and with different k, share steps; n = 2
    sampled choices each get one entry per token; logprobs=0 gives the chosen token only;
    more than max_logprobs (20) is refused naming the parameter."""
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=[5, 6, 7]), TokensPrompt(prompt_token_ids=[8, 9]),
         TokensPrompt(prompt_token_ids=[10, 11, 12, 13, 14])],
        [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
         SamplingParams(temperature=0.8, seed=4, n=2, max_tokens=9, ignore_eos=True,
                        logprobs=3),
         SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=0)],
        use_tqdm=False)
    assert outputs[0].outputs[0].logprobs is None
    for choice in outputs[1].outputs:
        assert len(choice.logprobs) == len(choice.token_ids) == 9
        for token, entry in zip(choice.token_ids, choice.logprobs):
            assert token in entry and 3 <= len(entry) <= 4
            assert all(e.logprob <= 0 for e in entry.values())
            assert {1, 2, 3} <= {e.rank for e in entry.values()}
    for token, entry in zip(outputs[2].outputs[0].token_ids, outputs[2].outputs[0].logprobs):
        assert list(entry) == [token]
    with pytest.raises((ValueError, VLLMValidationError), match="logprobs"):
        llm.generate(TokensPrompt(prompt_token_ids=[5, 6]),
                     SamplingParams(max_tokens=4, logprobs=30), use_tqdm=False)


def test_bad_words_of_one_and_two_tokens_never_appear(llm):
    """Two letters pushed to the top of every position (logit_bias): a one-token bad word
    takes the first away everywhere; the doubled first letter as a bad word leaves it
    everywhere but never twice in a row, although every step commits the whole block
    (threshold 0), so one step's commits complete the word unless undone."""
    first, second = letters(llm, 2)
    tok = llm.get_tokenizer()
    bias = {first: 100.0, second: 80.0}
    options = {"strategy": "threshold", "threshold": 0.0}

    def run(**params):
        (out,) = llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]),
                              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                             logit_bias=bias, extra_args=options, **params),
                              use_tqdm=False)
        return list(out.outputs[0].token_ids)

    assert run() == [first] * 12
    assert run(bad_words=[tok.decode([first])]) == [second] * 12
    doubled = run(bad_words=[tok.decode([first]) * 2])
    assert first in doubled and len(doubled) == 12
    assert all(pair != (first, first) for pair in zip(doubled, doubled[1:])), doubled


def test_logprob_token_ids_give_the_values_of_those_tokens(llm):
    """logprob_token_ids (what vLLM's generative-scoring endpoint sends): each token's entry
    holds the given tokens' logprobs in the same distribution as top-k logprobs."""
    prompt = TokensPrompt(prompt_token_ids=[5, 6, 7])
    (top,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                 logprobs=20), use_tqdm=False)
    given = sorted(top.outputs[0].logprobs[0])[:3]
    (scored,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6,
                                                    ignore_eos=True,
                                                    logprob_token_ids=given), use_tqdm=False)
    assert scored.outputs[0].token_ids == top.outputs[0].token_ids
    for token, entry, full in zip(scored.outputs[0].token_ids, scored.outputs[0].logprobs,
                                  top.outputs[0].logprobs):
        assert set(entry) == set(given) | {token}
        for t in given:
            if t in full:
                assert entry[t].logprob == pytest.approx(full[t].logprob, abs=1e-5)
