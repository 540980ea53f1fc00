"""No request stops the engine or runs forever: requests whose constraints bar every token
or overflow the logits are refused at admission (where that can be known) or end with an
error naming why at the step where it shows; grammar walks never stall; a request without
progress for the engine's limit of steps ends; every constraint holds in what is served.
Includes a property-based test drawing requests from the whole sampling surface (fixed
seed and example count; ``LIVENESS_EXAMPLES`` raises the count), run under every other
policy by ``test_liveness_policies.py``."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest
from conftest import diffusion_llm
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_faults import REJECTED, assert_idle_and_correct, runner_of, scheduler_of

from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import StructuredOutputsParams as Grammar

from vllm_diffusion.step.failures import Failure

pytestmark = pytest.mark.engine

BLOCK_SIZE = 4
PROMPT = TokensPrompt(prompt_token_ids=[5, 6, 7, 8, 9, 10, 11])
# Examples per policy in CI (the FOCUS engine gets twice as many); raise for a longer hunt.
EXAMPLES = int(os.environ.get("LIVENESS_EXAMPLES", "8"))


def reference_params(**extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, **extra)


@pytest.fixture(scope="module")
def llm(dense_checkpoint):
    with diffusion_llm(dense_checkpoint, diffusion_block_size=BLOCK_SIZE, max_model_len=128,
                       additional_config={"diffusion_policy": "focus"}) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference_tokens(llm) -> list[int]:
    return list(llm.generate(PROMPT, reference_params(), use_tqdm=False)[0].outputs[0].token_ids)


def stats(llm) -> dict:
    return dict(runner_of(llm).diffusion_stats_dict())


def served(llm, **fields):
    """The request's one choice, or the exception admission raised."""
    params = SamplingParams(**{"max_tokens": 16, "seed": 1, **fields})
    try:
        return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    except REJECTED as err:
        return err


# The requests: (fields, where it is caught, text of the reason).
UNSATISFIABLE = {
    "allowed_eos_min_tokens": (dict(allowed_token_ids=[2], min_tokens=5),
                               "admission", "minus the mask token, min_tokens=5"),
    "allowed_stops_min_tokens": (dict(allowed_token_ids=[0, 2], min_tokens=16,
                                      ignore_eos=True), "admission", "min_tokens=16"),
    "allowed_is_a_bad_word": (dict(allowed_token_ids=[5], bad_words=['"']), "admission",
                              "bad_words"),
    "regex_outside_allowed": (dict(structured_outputs=Grammar(regex="[0-9]{3}"),
                                   allowed_token_ids=[5]), "step", "structured_outputs"),
    "choice_all_bad_words": (dict(structured_outputs=Grammar(choice=["yes", "no"]),
                                  bad_words=["yes", "no", "y", "n"]), "step", "bad_words"),
    "overflowing_penalty": (dict(repetition_penalty=1e-38, ignore_eos=True), "step",
                            "not finite"),
}


@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("name", UNSATISFIABLE)
def test_unsatisfiable_requests_end_with_their_reason(llm, reference_tokens, name,
                                                      temperature):
    fields, where, reason = UNSATISFIABLE[name]
    before = stats(llm)
    out = served(llm, temperature=temperature, **fields)
    if where == "admission":
        assert isinstance(out, REJECTED) and "no token is left" in str(out), out
        assert reason in str(out)
    else:
        assert not isinstance(out, Exception), out
        assert out.finish_reason == "error"
        failure = Failure.from_stop_reason(out.stop_reason)
        assert failure is not None and failure.status == 400, out.stop_reason
        # The position the output needed next: everything before it was emitted.
        assert reason in failure.message
        assert f"output position {len(out.token_ids)} " in failure.message
        after = stats(llm)
        assert after["requests_unsatisfiable"] == before["requests_unsatisfiable"] + 1
    assert_idle_and_correct(llm, reference_tokens)


def test_an_unsatisfiable_request_beside_others_fails_alone(llm, reference_tokens):
    outputs = llm.generate([PROMPT] * 3, [
        reference_params(), SamplingParams(temperature=1.0, seed=1, max_tokens=16,
                                           repetition_penalty=1e-38, ignore_eos=True),
        reference_params()], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "error", "length"]
    assert list(outputs[0].outputs[0].token_ids) == reference_tokens
    assert list(outputs[2].outputs[0].token_ids) == reference_tokens
    assert_idle_and_correct(llm, reference_tokens)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_forced_text_with_a_special_tokens_literal_is_written_as_text(llm, temperature):
    out = served(llm, temperature=temperature,
                 structured_outputs=Grammar(regex="<\\|im_end\\|>abc"))
    assert out.finish_reason == "stop" and out.text == "<|im_end|>abc", out
    # The literal is characters, not the special token (which ends the output).
    assert 2 not in out.token_ids[:-1] and out.stop_reason == 2


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_forced_bad_word_ends_the_request_instead_of_stalling(llm, reference_tokens,
                                                                temperature):
    """``bad_words=["world"]`` with the grammar forcing "world peace": the word's
    tokenization the walk would force is barred, so the request ends with its reason (or
    writes the text with another tokenization); it never loops."""
    before = stats(llm)
    out = served(llm, temperature=temperature, bad_words=["world"],
                 structured_outputs=Grammar(regex="world peace"))
    steps = stats(llm)["engine_steps"] - before["engine_steps"]
    assert steps < 20, steps
    words = bad_word_ids(llm, ["world"])
    assert not any(contains(list(out.token_ids), w) for w in words)
    if out.finish_reason == "error":
        assert "bad_words" in Failure.from_stop_reason(out.stop_reason).message
    else:
        assert out.text == "world peace"
    assert_idle_and_correct(llm, reference_tokens)


def test_grammar_forced_tokens_pass_allowed_token_ids_and_min_tokens(llm):
    tok = llm.get_tokenizer()
    allowed = {t for ch in "abc " for t in tok.encode(ch, add_special_tokens=False)}
    assert len(tok.encode("abc abc abc", add_special_tokens=False)) < 11  # merges are barred
    out = served(llm, temperature=0, structured_outputs=Grammar(regex="abc abc abc"),
                 allowed_token_ids=sorted(allowed | {tok.eos_token_id}))
    assert out.finish_reason == "stop" and out.text == "abc abc abc", out
    assert set(out.token_ids) - {tok.eos_token_id} <= allowed
    # The grammar ends after "yes" by the stop token, which min_tokens bars: an error at
    # the step, never a stop token before min_tokens.
    out = served(llm, temperature=0, structured_outputs=Grammar(choice=["yes"]),
                 min_tokens=8)
    assert out.finish_reason == "error", out
    assert "min_tokens=8" in Failure.from_stop_reason(out.stop_reason).message


@pytest.mark.parametrize("where", ["logit stage", "grammar walk"])
def test_a_failure_in_proposals_or_the_grammar_stays_with_its_request(
        llm, reference_tokens, monkeypatch, where):
    """A logit stage or a grammar walk that raises for one request of a batch: that
    request alone ends with HTTP 500 naming the exception; the others decode as alone."""
    import vllm_diffusion.worker.grammar as grammar_module

    marker = 13  # max_tokens of the request whose step work raises
    runner = runner_of(llm)
    if where == "logit stage":
        def failing_stage(batch):
            if any(p.max_tokens == marker for p in batch.params):
                raise RuntimeError("injected stage failure")

        monkeypatch.setattr(runner.proposals, "logit_stages",
                            [*runner.proposals.logit_stages, failing_stage])
        marked = SamplingParams(temperature=0, max_tokens=marker, ignore_eos=True)
    else:
        def failing_walk(compiler, grammar, req_id, *args, **kwargs):
            raise RuntimeError("injected walk failure")

        monkeypatch.setattr(grammar_module, "walk", failing_walk)
        marked = SamplingParams(temperature=0, max_tokens=marker,
                                structured_outputs=Grammar(regex="[a-c]{5}"))
    before = stats(llm)
    outputs = llm.generate([PROMPT] * 3, [reference_params(), marked, reference_params()],
                           use_tqdm=False)
    monkeypatch.undo()
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "error", "length"]
    failure = Failure.from_stop_reason(outputs[1].outputs[0].stop_reason)
    assert failure.status == 500 and f"injected {where.split()[-1]} failure" in failure.message
    for i in (0, 2):
        assert list(outputs[i].outputs[0].token_ids) == reference_tokens
    assert stats(llm)["requests_failed"] == before["requests_failed"] + 1
    assert_idle_and_correct(llm, reference_tokens)


@pytest.mark.parametrize("bias", ["NaN", "inf", float("-inf"), 1e400])
def test_non_finite_logit_bias_is_refused(llm, bias):
    out = served(llm, temperature=0, logit_bias={5: float(bias)})
    assert isinstance(out, REJECTED) and "logit_bias must map token ids to finite" in str(out)


def test_a_request_without_progress_ends_at_the_limit(llm, reference_tokens, monkeypatch):
    """A walk that never takes a token (as the grammar walk once stalled): the request
    ends after the engine's limit of steps without progress, its KV freed, counted; the
    engine serves the next request. (The limit is lowered on the running engine: a second
    engine in this process would tear down the distributed state the first one uses.)"""
    import vllm_diffusion.worker.grammar as grammar_module

    limit = 6
    runner = runner_of(llm)
    monkeypatch.setattr(runner.updates, "max_steps_without_progress", limit)
    monkeypatch.setattr(grammar_module, "walk",
                        lambda *args, **kwargs: grammar_module.Walk([], []))
    before = stats(llm)
    out = served(llm, temperature=0, structured_outputs=Grammar(regex="[a-c]{5}"))
    after = stats(llm)
    monkeypatch.undo()
    assert out.finish_reason == "error"
    failure = Failure.from_stop_reason(out.stop_reason)
    assert failure.status == 500 and f"no progress in {limit} consecutive" in failure.message
    assert after["denoising_steps"] - before["denoising_steps"] == limit
    assert after["requests_without_progress"] == before["requests_without_progress"] + 1
    assert_idle_and_correct(llm, reference_tokens)


# ------------------------------------------------------------------ property-based
def bad_word_ids(llm, words: list[str]) -> list[list[int]]:
    """vLLM's tokenizations of ``words`` (with and without a leading space)."""
    params = SamplingParams(bad_words=words)
    params.update_from_tokenizer(llm.get_tokenizer())
    return params.bad_words_token_ids or []


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"],
          "additionalProperties": False}
GRAMMARS = {
    "regex": (lambda: Grammar(regex="[a-c]{3}x"), lambda t: re.fullmatch("[a-c]{3}x", t)),
    "choice": (lambda: Grammar(choice=["yes", "no", "maybe"]),
               lambda t: t in ("yes", "no", "maybe")),
    "json": (lambda: Grammar(json=SCHEMA),
             lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    "special_literal": (lambda: Grammar(regex="<\\|im_end\\|>[ab]"),
                        lambda t: re.fullmatch("<\\|im_end\\|>[ab]", t)),
}
TOKENS = st.integers(0, 60)
SURFACE = st.fixed_dictionaries({}, optional={
    "temperature": st.sampled_from([0.0, 1.0, 1e-5, 2.0]),
    "top_p": st.sampled_from([1.0, 0.5, 1e-9]),
    "top_k": st.sampled_from([-1, 0, 1, 5]),
    "min_p": st.sampled_from([0.0, 0.5, 1.0]),
    "seed": st.integers(0, 5),
    "max_tokens": st.integers(1, 24),
    "min_tokens": st.integers(0, 12),
    "n": st.integers(1, 2),
    "ignore_eos": st.booleans(),
    "repetition_penalty": st.sampled_from([1.0, 1e-38, 1e-3, 2.0, 1e6]),
    "frequency_penalty": st.sampled_from([0.0, -2.0, 2.0]),
    "presence_penalty": st.sampled_from([0.0, -2.0, 2.0]),
    "allowed_token_ids": st.lists(TOKENS, min_size=1, max_size=4, unique=True),
    "bad_words": st.lists(st.sampled_from(['"', "a", "yes", "no", "the", "ab", "world"]),
                          min_size=1, max_size=3),
    "logit_bias": st.dictionaries(TOKENS, st.sampled_from([-100.0, 100.0, 1e30, -1e30,
                                                           3e38]), max_size=3),
    "stop": st.lists(st.sampled_from(["a", "x", "."]), max_size=2),
    "grammar": st.sampled_from(sorted(GRAMMARS)),
})


def check_constraints(llm, fields: dict, choice) -> None:
    """Every constraint the request asked for holds in a served choice."""
    tokens = list(choice.token_ids)
    tok = llm.get_tokenizer()
    assert len(tokens) <= fields.get("max_tokens", 16)
    if "allowed_token_ids" in fields:
        assert set(tokens) <= set(fields["allowed_token_ids"]), tokens
    for word in bad_word_ids(llm, fields.get("bad_words", [])):
        assert not contains(tokens, word), (word, tokens)
    stops = {tok.eos_token_id} if not fields.get("ignore_eos") else set()
    minimum = fields.get("min_tokens", 0)
    assert not stops & set(tokens[:minimum]), tokens
    for text in fields.get("stop", []):
        assert text not in choice.text
    if "grammar" in fields and choice.finish_reason == "stop" and not fields.get("stop"):
        assert GRAMMARS[fields["grammar"]][1](choice.text), choice.text


def assert_idle(llm) -> None:
    """Nothing held: no request, every KV page free, the runner's diffusion state dropped
    (checked by a request after the idle check)."""
    scheduler = scheduler_of(llm)
    assert not scheduler.requests and not scheduler.running and not len(scheduler.waiting)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # one null block
    llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    runner = runner_of(llm)
    assert set(runner.diffusion_requests) <= set(runner.requests)


def generate_and_check(llm, reference_tokens, fields: dict, extra_args=None) -> None:
    """``reference_tokens``: the reference request's greedy output, or None where the
    policy's greedy output depends on the load (elastic chooses its chunk by it)."""
    sampling = {k: v for k, v in fields.items() if k != "grammar"}
    if "grammar" in fields:
        sampling["structured_outputs"] = GRAMMARS[fields["grammar"]][0]()
    sampling.setdefault("max_tokens", 16)
    try:
        params = SamplingParams(**sampling, extra_args=extra_args)
    except REJECTED:
        event("refused by SamplingParams")
        return
    before = stats(llm)
    try:
        outputs = llm.generate([PROMPT, PROMPT], [reference_params(), params], use_tqdm=False)
    except REJECTED:
        event("refused at admission")
    else:
        if reference_tokens is not None:
            assert list(outputs[0].outputs[0].token_ids) == reference_tokens
        assert len(outputs[1].outputs) == params.n
        for choice in outputs[1].outputs:
            event(f"finished: {choice.finish_reason}")
            assert choice.finish_reason in ("length", "stop", "error")
            if choice.finish_reason == "error":
                failure = Failure.from_stop_reason(choice.stop_reason)
                assert failure is not None and failure.status == 400, choice.stop_reason
                event(f"error: {failure.message.split(' at output')[0]}")
            else:
                check_constraints(llm, fields, choice)
        # Ends within the bound: each denoising step of a request writes a token or ends
        # a block at least every `limit` steps, and it has at most max_tokens + 2 blocks.
        limit = runner_of(llm).diffusion.max_steps_without_progress
        steps = stats(llm)["denoising_steps"] - before["denoising_steps"]
        bound = (1 + params.n) * (params.max_tokens + 2 * BLOCK_SIZE) * limit
        assert steps <= bound, (steps, bound)
    if reference_tokens is None:
        assert_idle(llm)
    else:
        assert_idle_and_correct(llm, reference_tokens)


@settings(max_examples=EXAMPLES * 2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(fields=SURFACE)
def test_generated_requests_end_honour_their_constraints_and_leave_nothing(
        llm, reference_tokens, fields):
    generate_and_check(llm, reference_tokens, fields)
