"""Compact JSON (``compact_json.py``): for the plugin's models a JSON request's grammar, as
the worker compiles it from the configuration vLLM builds, allows no whitespace between
JSON tokens by default, and any whitespace with ``diffusion_json_any_whitespace``."""

from __future__ import annotations

import pytest
from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import StructuredOutputsParams

from vllm_diffusion.config import parse_engine_options
from vllm_diffusion.options import OptionError
from vllm_diffusion.worker.grammar import GrammarCompiler, unpack
from vllm_diffusion.worker.outputs import DiffusionStats

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}}}
# JSON text so far -> where free whitespace may follow (between JSON tokens)
PREFIXES = ('{', '{"name"', '{"name":', '{"name":"x"')


def engine_config(checkpoint, **additional_config):
    """vLLM's configuration as ``vllm serve`` builds it (the plugin's config hook run)."""
    return EngineArgs(model=str(checkpoint), max_model_len=256, enforce_eager=True,
                      additional_config=additional_config).create_engine_config()


def whitespace_allowed_after(vllm_config, structured_outputs) -> dict[str, set[str]]:
    """For each prefix of ``PREFIXES``: the whitespace-only tokens the request's grammar
    allows next, compiled by the worker's compiler (vLLM's xgrammar backend)."""
    compiler = GrammarCompiler(vllm_config, DiffusionStats())
    params = SamplingParams(structured_outputs=structured_outputs)
    params.structured_outputs._backend = "xgrammar"  # as vLLM's admission resolves "auto"
    grammar = compiler.compile(params)
    tokenizer = compiler.tokenizer
    whitespace = {i: text for i in range(len(tokenizer))
                  if (text := tokenizer.decode([i])) and text.isspace()}
    assert {" ", "\n"} <= set(whitespace.values())
    allowed_after = {}
    for prefix in PREFIXES:
        ids = tokenizer.encode(prefix, add_special_tokens=False)
        assert all(grammar.accept_tokens("request", [i]) for i in ids), prefix
        allowed = unpack(compiler.allowed(grammar), compiler.vocab_size)
        allowed_after[prefix] = {text for i, text in whitespace.items() if allowed[i]}
        grammar.rollback(len(ids))
    return allowed_after


@pytest.mark.parametrize("structured_outputs", [
    StructuredOutputsParams(json_object=True), StructuredOutputsParams(json=SCHEMA)],
    ids=["json_object", "json_schema"])
def test_json_grammars_are_compact_unless_the_engine_allows_whitespace(
        dense_checkpoint, structured_outputs):
    compact = engine_config(dense_checkpoint)
    assert compact.structured_outputs_config.disable_any_whitespace
    assert all(not found for found in
               whitespace_allowed_after(compact, structured_outputs).values())
    spacious = engine_config(dense_checkpoint, diffusion_json_any_whitespace=True)
    assert not spacious.structured_outputs_config.disable_any_whitespace
    for prefix, found in whitespace_allowed_after(spacious, structured_outputs).items():
        assert {" ", "\n"} <= found, prefix


def test_the_whitespace_option_is_typed_and_never_contradicts_vllms():
    resolved = parse_engine_options({"diffusion_json_any_whitespace": "true"},
                                    config_block_size=8, config_mask_token_id=3,
                                    vocab_size=100)
    assert resolved.json_any_whitespace is True
    assert resolved.to_dict()["diffusion_json_any_whitespace"] is True
    with pytest.raises(OptionError, match="'diffusion_json_any_whitespace' must be bool"):
        parse_engine_options({"diffusion_json_any_whitespace": "sometimes"},
                             config_block_size=8, config_mask_token_id=3, vocab_size=100)


def test_whitespace_allowed_by_the_plugin_and_barred_by_vllm_is_refused(dense_checkpoint):
    with pytest.raises(ValueError, match="set only one of them"):
        EngineArgs(model=str(dense_checkpoint), max_model_len=256, enforce_eager=True,
                   structured_outputs_config={"backend": "xgrammar",
                                              "disable_any_whitespace": True},
                   additional_config={"diffusion_json_any_whitespace": True},
                   ).create_engine_config()
