"""The engine-wide limits on what multiplies one request's work: validated at start-up
with the other engine options, engine-wide only, and a request over one is refused naming
the limit and its value (at the limit it passes). Fast, no engine."""

from __future__ import annotations

import pytest

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams

from vllm_diffusion.config import DiffusionEngineConfig, parse_engine_options
from vllm_diffusion.options import OptionError
from vllm_diffusion.policies.standard import StandardConfig
from vllm_diffusion.request_limits import (
    RequestLimits,
    check_bad_word_tokens,
    check_request_limits,
    grammar_chars,
)

TIGHT = RequestLimits(max_n=4, max_bad_words=3, max_bad_word_tokens=10, max_grammar_chars=20)


def parse(**values) -> DiffusionEngineConfig:
    return parse_engine_options(values, config_block_size=8, config_mask_token_id=0,
                                vocab_size=100)


def test_limits_have_documented_defaults_and_round_trip():
    config = parse()
    assert config.limits == RequestLimits(max_n=16, max_bad_words=64,
                                          max_bad_word_tokens=1024, max_grammar_chars=65536)
    raised = parse(diffusion_max_n=64, diffusion_max_bad_words=0,
                   diffusion_max_bad_word_tokens=5, diffusion_max_grammar_chars="300")
    assert raised.limits == RequestLimits(64, 0, 5, 300)
    assert parse(**raised.to_dict()) == raised
    assert raised.compute_hash() != config.compute_hash()


@pytest.mark.parametrize("key, value, message", [
    ("diffusion_max_n", 0, r"option 'diffusion_max_n' must be int in \[1, 16384\], got 0"),
    ("diffusion_max_n", 20000, "option 'diffusion_max_n' must be int"),
    ("diffusion_max_bad_words", -1, "option 'diffusion_max_bad_words' must be int"),
    ("diffusion_max_bad_word_tokens", 1.5, "option 'diffusion_max_bad_word_tokens' must be int"),
    ("diffusion_max_grammar_chars", 0, "option 'diffusion_max_grammar_chars' must be int"),
    ("diffusion_max_grammar_chars", None, "option 'diffusion_max_grammar_chars' must be int"),
])
def test_bad_limit_values_stop_the_start_up(key, value, message):
    with pytest.raises(OptionError, match=message):
        parse(**{key: value})


def test_limits_are_not_request_options():
    engine = DiffusionEngineConfig("standard", 8, 0, StandardConfig())
    with pytest.raises(OptionError, match="unknown option.*'diffusion_max_n'"):
        engine.request_policy_config({"diffusion_max_n": 1000})


def refusal(params: SamplingParams, check=check_request_limits) -> str:
    with pytest.raises(VLLMValidationError) as err:
        check(params, TIGHT)
    return str(err.value)


def test_n_over_the_limit_is_refused_naming_it():
    check_request_limits(SamplingParams(n=4, temperature=1.0), TIGHT)
    message = refusal(SamplingParams(n=5, temperature=1.0))
    assert "n=5" in message and "diffusion_max_n=4" in message


def test_bad_words_over_the_limits_are_refused_naming_them():
    check_request_limits(SamplingParams(bad_words=["a", "b", "c"]), TIGHT)
    message = refusal(SamplingParams(bad_words=["a", "b", "c", "d"]))
    assert "bad_words holds 4 words" in message and "diffusion_max_bad_words=3" in message
    check_request_limits(SamplingParams(bad_words=["a" * 100, "b" * 60]), TIGHT)
    message = refusal(SamplingParams(bad_words=["a" * 100, "b" * 61]))  # 16 x 10 < 161
    assert "bad_words hold 161 characters" in message and "more than 16 characters" in message
    assert "diffusion_max_bad_word_tokens=10" in message
    params = SamplingParams()
    params._bad_words_token_ids = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10]]  # 10 tokens
    check_bad_word_tokens(params, TIGHT)
    params._bad_words_token_ids.append([11])
    message = refusal(params, check_bad_word_tokens)
    assert "bad_words tokenize to 11 tokens (3 tokenizations" in message
    assert "diffusion_max_bad_word_tokens=10" in message


@pytest.mark.parametrize("constraint, size", [
    ({"regex": "a" * 20}, {"regex": 20}),
    ({"json": {"type": "string"}}, {"json": 18}),  # as JSON text: {"type": "string"}
    ({"json": '{"type":"string"}'}, {"json": 17}),
    ({"choice": ["yes", "no"]}, {"choice": 5}),
    ({"grammar": "root ::= [a-z]+", "whitespace_pattern": None}, {"grammar": 15}),
    ({"json_object": True, "whitespace_pattern": "[ ]?"}, {"whitespace_pattern": 4}),
], ids=["regex", "json-object", "json-text", "choice", "grammar", "whitespace"])
def test_grammar_size_counts_every_text_the_grammar_is_built_from(constraint, size):
    wanted = StructuredOutputsParams(**constraint)
    assert grammar_chars(wanted) == size
    check_request_limits(SamplingParams(structured_outputs=wanted), TIGHT)  # <= 20


def test_a_grammar_over_the_limit_is_refused_naming_it():
    message = refusal(SamplingParams(structured_outputs=StructuredOutputsParams(
        regex="a" * 15, whitespace_pattern="[ ]{1,2}")))
    assert "the constraint has 23 characters (regex 15 + whitespace_pattern 8)" in message
    assert "diffusion_max_grammar_chars=20" in message
