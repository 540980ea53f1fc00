"""What parsing an OpenAI request loses (``seams/openai_serving.py``): non-finite
``logit_bias`` values, which ``SamplingParams.from_optional`` clamps into finite ones, and
booleans in ``vllm_xargs``, which the request schema turns into 1 / 0. Fast, no engine:
the requests are parsed by vLLM's own request models from the JSON text a client sends."""

from __future__ import annotations

import asyncio
import json
import math
import types

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.exceptions import VLLMValidationError

from vllm_diffusion.config import DiffusionEngineConfig
from vllm_diffusion.options import OptionError
from vllm_diffusion.policies.standard import StandardConfig
from vllm_diffusion.requests import check_logit_bias
from vllm_diffusion.seams.openai_serving import _checking, restore_booleans

CHAT = '{"model": "m", "messages": [{"role": "user", "content": "hi"}], %s}'

# the bias as the client writes it in the JSON text
NON_FINITE_BIASES = ['"NaN"', '"nan"', '"inf"', '"-inf"', '"Infinity"', '"-Infinity"',
                     "NaN", "Infinity", "-Infinity", "1e400", "-1e400"]


def chat_request(fields: str) -> tuple[ChatCompletionRequest, dict]:
    body = json.loads(CHAT % fields)  # Python's json, as the server's, reads NaN and 1e400
    return ChatCompletionRequest.model_validate(body), body


@pytest.mark.parametrize("bias", NON_FINITE_BIASES)
def test_a_non_finite_bias_is_refused_naming_its_token(bias):
    request, _ = chat_request(f'"logit_bias": {{"5": 1.5, "42": {bias}}}')
    # what the seam exists for: vLLM's conversion makes every such bias finite
    converted = request.to_sampling_params(4, {}).logit_bias
    assert all(math.isfinite(value) for value in converted.values())
    with pytest.raises(VLLMValidationError, match="logit_bias must map token ids to finite "
                                                  "numbers, got .* for token 42\\b"):
        check_logit_bias(request.logit_bias)


def test_finite_biases_and_offline_token_ids_pass_and_name_the_token():
    check_logit_bias({"5": -100.0, "6": 100, "7": 0.0})
    check_logit_bias(None)
    with pytest.raises(VLLMValidationError, match=r"for token 7\b"):
        check_logit_bias({5: 1.0, 7: float("nan")})


def test_a_boolean_given_to_a_number_option_is_put_back_and_refused():
    request, body = chat_request('"vllm_xargs": {"threshold": true, "strategy": '
                                 '"low_confidence_dynamic", "sub_block_cache": true}')
    assert request.vllm_xargs["threshold"] == 1 and type(request.vllm_xargs["threshold"]) is int
    restore_booleans(request.vllm_xargs, body)
    assert request.vllm_xargs == {"threshold": True, "strategy": "low_confidence_dynamic",
                                  "sub_block_cache": True}
    engine = DiffusionEngineConfig("standard", 8, 0, StandardConfig())
    with pytest.raises(OptionError, match=r"option 'threshold' must be float in \[0.0, 1.0\], "
                                          r"got True"):
        engine.request_policy_config(request.vllm_xargs)
    # a boolean option still takes its boolean
    assert engine.request_policy_config({"sub_block_cache": True}).sub_block_cache is True


@pytest.mark.parametrize("extra, message", [
    ({"threshold": True}, r"option 'threshold' must be float in \[0.0, 1.0\], got True"),
    ({"threshold": False}, r"option 'threshold' must be float in \[0.0, 1.0\], got False"),
    ({"denoising_steps": True}, r"option 'denoising_steps' must be int"),
])
def test_the_options_parser_refuses_a_boolean_where_a_number_is_expected(extra, message):
    engine = DiffusionEngineConfig("standard", 8, 0, StandardConfig())
    with pytest.raises(OptionError, match=message):
        engine.request_policy_config(extra)


def test_only_values_the_body_gave_as_booleans_are_put_back():
    xargs = {"threshold": 1, "denoising_steps": 1, "ids": [1, 2], "name": "x"}
    restore_booleans(xargs, {"vllm_xargs": {"threshold": 1, "denoising_steps": True,
                                            "ids": [True, 2], "name": True}})
    assert xargs == {"threshold": 1, "denoising_steps": True, "ids": [True, 2], "name": "x"}
    # a body of another shape (an Anthropic request turned into a chat one), or none
    for body in (None, {"messages": []}, {"vllm_xargs": [True]}, "text"):
        same = {"threshold": 1}
        restore_booleans(same, body)
        assert same == {"threshold": 1}


class FakeServing:
    """An OpenAI handler's surface the wrapper uses."""

    def __init__(self, architecture: str):
        self.model_config = types.SimpleNamespace(architecture=architecture)
        self.seen = []

    @staticmethod
    def create_error_response(error):
        return ("error", 400, str(error))

    async def create_completion(self, request, raw_request=None):
        self.seen.append(dict(request.vllm_xargs or {}))
        return "handled"


class FakeRawRequest:
    def __init__(self, body: dict):
        self.body = body

    async def json(self):
        return self.body


def handle(architecture: str, text: str):
    body = json.loads(text)
    serving = FakeServing(architecture)
    wrapped = _checking(FakeServing.create_completion)
    result = asyncio.run(wrapped(serving, CompletionRequest.model_validate(body),
                                 FakeRawRequest(body)))
    return result, serving.seen


def test_the_wrapper_answers_a_bad_bias_and_restores_booleans_for_diffusion_models_only():
    bad = '{"model": "m", "prompt": "hi", "logit_bias": {"9": NaN}}'
    result, seen = handle("SDARForCausalLM", bad)
    assert result[:2] == ("error", 400) and "for token 9" in result[2] and not seen
    assert handle("Qwen3ForCausalLM", bad) == ("handled", [{}])
    flagged = '{"model": "m", "prompt": "hi", "vllm_xargs": {"threshold": true}}'
    assert handle("SDARForCausalLM", flagged) == ("handled", [{"threshold": True}])
    result, seen = handle("Qwen3ForCausalLM", flagged)
    assert type(seen[0]["threshold"]) is int  # other models see vLLM's parse as it is
