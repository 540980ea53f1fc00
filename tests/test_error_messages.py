"""Error messages are at most 1 KB (``error_messages.py``): option errors name the first
few offending keys and a count, and the exits cut what is still longer while keeping the
status the server answers with."""

from __future__ import annotations

from http import HTTPStatus

import pytest
from vllm.exceptions import GracefulHTTPError, VLLMServerError, VLLMValidationError

from vllm_diffusion.config import parse_engine_options
from vllm_diffusion.error_messages import MESSAGE_LIMIT, capped, capped_error, errors_capped
from vllm_diffusion.options import OptionError
from vllm_diffusion.step.failures import Failure

UNKNOWN = {f"key{i}": 1 for i in range(10_000)}


def resolve(**options):
    return parse_engine_options(options, config_block_size=8, config_mask_token_id=3,
                                vocab_size=100)


def test_ten_thousand_unknown_keys_are_named_by_the_first_five_and_a_count():
    for refuse in (lambda: resolve(**UNKNOWN),
                   lambda: resolve(diffusion_policy="focus").request_policy_config(UNKNOWN)):
        with pytest.raises(OptionError) as refused:
            refuse()
        message = str(refused.value)
        assert "unknown option(s) 'key0', 'key1', 'key10', 'key100', 'key1000' and 9995 " \
               "more; valid options for policy" in message
        assert len(message.encode()) <= MESSAGE_LIMIT


def test_capped_keeps_short_messages_and_cuts_long_ones_at_a_character():
    assert capped("short") == "short"
    cut = capped("é" * 2000)  # two bytes each: the cut must not split one
    assert len(cut.encode()) <= MESSAGE_LIMIT and cut.endswith("(message cut: 4000 bytes)")
    assert cut.startswith("é" * 400)


def test_a_cut_error_keeps_the_status_the_server_answers_with():
    huge = "x" * 5000
    validation = capped_error(VLLMValidationError(huge, parameter="extra_args", value=huge))
    assert isinstance(validation, VLLMValidationError) and validation.parameter == "extra_args"
    graceful = capped_error(GracefulHTTPError(huge, HTTPStatus.SERVICE_UNAVAILABLE))
    assert graceful.http_status == HTTPStatus.SERVICE_UNAVAILABLE
    assert type(capped_error(ValueError(huge))) is ValueError
    assert type(capped_error(UnicodeDecodeError("utf-8", b"", 0, 1, huge))) \
        is VLLMValidationError  # a ValueError subclass: 400 as well
    assert isinstance(capped_error(RuntimeError(huge)), VLLMServerError)
    for err in (validation, graceful, capped_error(RuntimeError(huge))):
        assert len(str(err).encode()) <= MESSAGE_LIMIT
    small = ValueError("fits")
    assert capped_error(small) is small


def test_errors_capped_raises_the_cut_error_from_the_original():
    with pytest.raises(VLLMValidationError) as raised, errors_capped():
        raise VLLMValidationError("y" * 5000, parameter="structured_outputs")
    assert len(str(raised.value).encode()) <= MESSAGE_LIMIT
    assert len(str(raised.value.__cause__)) > 5000


def test_a_step_failure_travels_cut():
    reason = Failure(400, "z" * 5000).as_stop_reason()
    failure = Failure.from_stop_reason(reason)
    assert failure.status == 400 and len(failure.message.encode()) <= MESSAGE_LIMIT


def test_the_workers_compiler_fails_an_uncompilable_grammar_as_a_client_error(
        dense_checkpoint):
    """The worker compiles a grammar again for its matcher: a failure there ends the
    request with a 400 naming the grammar, as the engine core's does."""
    import json

    from test_compact_json import engine_config
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_diffusion.step.failures import UncompilableGrammar
    from vllm_diffusion.worker.grammar import GrammarCompiler
    from vllm_diffusion.worker.outputs import DiffusionStats

    tag = {"type": "structural_tag", "format": {"type": "token", "token": 999_999}}
    params = SamplingParams(
        structured_outputs=StructuredOutputsParams(structural_tag=json.dumps(tag)))
    params.structured_outputs._backend = "xgrammar"
    compiler = GrammarCompiler(engine_config(dense_checkpoint), DiffusionStats())
    with pytest.raises(UncompilableGrammar, match="the structural tag could not be compiled: "
                       "RuntimeError: .*Token id 999999") as refused:
        compiler.compile(params)
    assert Failure.of(refused.value, "compiling its grammar").status == 400
