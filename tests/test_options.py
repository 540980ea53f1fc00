"""Option parsing and FOCUS's budget on any value: fast, no engine."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_diffusion.options import OptionError, Rule
from vllm_diffusion.kernels.selection import token_budget

UNIT = Rule(float, low=0.0, high=1.0)
UNBOUNDED = Rule(float)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "nan", "inf", "-inf"])
@pytest.mark.parametrize("rule", [UNIT, UNBOUNDED], ids=["bounded", "unbounded"])
def test_non_finite_floats_are_rejected(rule, value):
    with pytest.raises(OptionError, match=r"option 'x' must be a finite float"):
        rule.check("x", value, "test")


def test_integer_too_large_for_a_float_is_an_option_error():
    with pytest.raises(OptionError, match="too large for a float"):
        UNBOUNDED.check("x", 10**400, "test")


@pytest.mark.parametrize("value, expected", [(0.5, 0.5), (1, 1.0), ("0.25", 0.25)])
def test_finite_floats_pass(value, expected):
    assert UNIT.check("x", value, "test") == expected


@pytest.mark.parametrize("alpha, mean_decoded", [
    (math.nan, 1.0), (1.5, math.nan), (math.inf, 1.0), (1e308, 1e308), (64.0, 0.0)])
def test_token_budget_is_a_count_in_range_for_any_float(alpha, mean_decoded):
    delta = torch.tensor([0.1, float("nan"), 0.3, 5.0])
    budget = token_budget(delta, mean_decoded, alpha, block_size=8)
    assert isinstance(budget, int) and 1 <= budget <= 8


def test_post_steps_are_bounded_by_the_engine_limit():
    """A request's 'max_post_steps' multiplies its work (one forward of the block per post
    step): above the engine-wide 'max_post_steps_limit' it is refused naming the limit,
    and the limit itself cannot be raised per request."""
    from vllm_diffusion.config import DiffusionEngineConfig
    from vllm_diffusion.policies.standard import StandardConfig

    engine = DiffusionEngineConfig("standard", 8, 0, StandardConfig())
    assert engine.request_policy_config({"max_post_steps": 64}).max_post_steps == 64
    with pytest.raises(OptionError, match=r"'max_post_steps' must be at most the engine's "
                                          r"'max_post_steps_limit' \(64\), got 4096"):
        engine.request_policy_config({"editing_threshold": 0.0, "max_post_steps": 4096})
    with pytest.raises(OptionError, match=r"'max_post_steps_limit' is engine-wide"):
        engine.request_policy_config({"max_post_steps_limit": 500})
    roomy = DiffusionEngineConfig("standard", 8, 0, StandardConfig(max_post_steps_limit=200))
    assert roomy.request_policy_config({"max_post_steps": 150}).max_post_steps == 150


def test_errors_echo_at_most_a_short_cut_of_the_clients_value():
    """A megabyte-long value (an option's value, an unknown option's name, a refused
    sampling parameter) comes back cut, with its length."""
    from vllm.exceptions import VLLMValidationError

    from vllm_diffusion.config import DiffusionEngineConfig
    from vllm_diffusion.policies.standard import StandardConfig
    from vllm_diffusion.requests import validate_sampling_params

    huge = "x" * 5_000_000
    engine = DiffusionEngineConfig("standard", 8, 0, StandardConfig())
    for extra in ({"strategy": huge}, {huge: 1}, {"diffusion_policy": huge}):
        with pytest.raises(OptionError) as err:
            engine.request_policy_config(extra)
        assert len(str(err.value)) < 1000 and "5000002 characters" in str(err.value)
    from vllm import SamplingParams

    params = SamplingParams(trace_decode_token_ids=list(range(100_000)))
    with pytest.raises(VLLMValidationError) as err:
        validate_sampling_params(params, engine)
    assert len(str(err.value)) < 1000 and "trace_decode_token_ids" in str(err.value)


def test_kv_transfer_params_is_refused_by_name():
    """The OpenAI layer puts a request's top-level kv_transfer_params into extra_args: it
    is refused naming it (not as an unknown option); an empty one asks for nothing."""
    from vllm_diffusion.config import DiffusionEngineConfig
    from vllm_diffusion.policies.standard import StandardConfig

    engine = DiffusionEngineConfig("standard", 8, 0, StandardConfig())
    with pytest.raises(OptionError, match=r"^kv_transfer_params: KV-cache transfer between "
                                          r"engines .* is not supported"):
        engine.request_policy_config({"kv_transfer_params": {"do_remote_decode": True}})
    assert engine.request_policy_config({"kv_transfer_params": {}}) == engine.policy_config


@pytest.mark.parametrize("buckets, message", [
    ([], "non-empty list"), (8, "non-empty list"), ([16, 8], "must be increasing"),
    ([8, 8], "must be increasing"), ([0, 8], "diffusion_row_buckets"),
    (["x"], "diffusion_row_buckets")])
def test_row_buckets_are_validated(buckets, message):
    from vllm_diffusion.config import parse_engine_options

    with pytest.raises(OptionError, match=message):
        parse_engine_options({"diffusion_row_buckets": buckets}, config_block_size=8,
                             config_mask_token_id=0, vocab_size=100)
    config = parse_engine_options({"diffusion_row_buckets": [8, 32]}, config_block_size=8,
                                  config_mask_token_id=0, vocab_size=100)
    assert config.row_buckets == (8, 32)
    assert parse_engine_options(config.to_dict(), config_block_size=None,
                                config_mask_token_id=None, vocab_size=100) == config


def test_step_cap_is_bounded_by_the_engine_limit():
    from vllm_diffusion.config import DiffusionEngineConfig
    from vllm_diffusion.policies.standard import StandardConfig

    engine = DiffusionEngineConfig("standard", 8, 0, StandardConfig())
    with pytest.raises(OptionError, match=r"'max_steps_per_block_limit' \(1000\), got 1001"):
        engine.request_policy_config({"max_steps_per_block": 1001})
    with pytest.raises(OptionError, match="'max_steps_per_block_limit' is engine-wide"):
        engine.request_policy_config({"max_steps_per_block_limit": 5000})
