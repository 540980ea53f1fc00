"""A model family's declared needs against a policy's declared traits: one check
(``capabilities.refusal``) at start-up and per request, stated on the declarations only."""

from __future__ import annotations

import pytest

from vllm_diffusion.capabilities import (ModelCapabilities, model_refusal, refusal,
                                         request_refusal)
from vllm_diffusion.models.configs import (FastDLLMQwenConfig, LLaDA2MoeConfig, SDARConfig,
                                           model_capabilities)
from vllm_diffusion.policies import POLICIES

FIXED = ModelCapabilities(family="Fixed")
MOVING = ModelCapabilities(family="Moving", edit_tokens=(10, 11), routing_block_size=4)


def test_a_model_with_fixed_positions_takes_every_policy_with_any_options():
    for name, policy in POLICIES.items():
        assert refusal(FIXED, policy, {}) is None, name
    assert refusal(FIXED, POLICIES["standard"], {"chunk_size": 2, "chunk_reuse": True}) is None


def test_options_of_the_rewriting_loop_are_refused_only_where_tokens_stay_put():
    standard = POLICIES["standard"]
    message = refusal(FIXED, standard, {"max_steps_per_block": 10})
    assert message is not None and "'max_steps_per_block'" in message and "Fixed" in message
    # resolved options carry every field: only what the user gave is refused
    assert refusal(FIXED, standard, {"max_steps_per_block": 1000}, given={}) is None
    assert refusal(MOVING, standard, {"max_steps_per_block": 10}) is None


def test_whole_block_routing_refuses_policies_that_compute_part_of_a_block():
    for name in ("es", "elastic"):
        message = refusal(MOVING, POLICIES[name], {})
        assert message.startswith(f"the {name} policy cannot serve Moving:"), message
    assert "drops rows inside the forward" in refusal(MOVING, POLICIES["es"], {})
    assert "'intra_block_cache'" in refusal(MOVING, POLICIES["ada"], {"intra_block_cache": True})
    routed = ModelCapabilities(family="Routed", routing_block_size=4)
    # whole blocks in every forward: only the keys are selected, or only commits decided
    for name in ("sparse_prefix", "ada"):
        assert refusal(routed, POLICIES[name], {}) is None, name
        message = refusal(MOVING, POLICIES[name], {})
        assert message.startswith(f"the {name} policy cannot serve Moving, whose edits "
                                  f"move tokens"), message
    assert "'chunk_size' and 'chunk_reuse'" in refusal(MOVING, POLICIES["standard"],
                                                       {"chunk_reuse": True})
    focus = POLICIES["focus"]
    assert "full budget" in refusal(MOVING, focus, {"evict": False})
    assert refusal(MOVING, focus, {"evict": False, "intra_block_cache": False}) is None
    assert refusal(MOVING, POLICIES["standard"], {}) is None


def test_the_block_size_holds_whole_routing_blocks():
    standard = POLICIES["standard"]
    assert "multiple of it" in refusal(MOVING, standard, {}, block_size=6)
    assert refusal(MOVING, standard, {}, block_size=8) is None
    assert refusal(FIXED, standard, {}, block_size=6) is None


def test_moving_tokens_need_the_rewriting_loops_own_unmasking_rule():
    message = refusal(MOVING, POLICIES["standard"], {"strategy": "sequential"})
    assert "whose edits move tokens" in message and "'strategy'" in message
    assert refusal(MOVING, POLICIES["standard"],
                   {"strategy": "low_confidence_dynamic"}) is None


def test_request_features_that_need_fixed_positions():
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    greedy = SamplingParams(temperature=0)
    assert request_refusal(MOVING, greedy) is None
    cases = [(SamplingParams(temperature=0.7), "temperature"),
             (SamplingParams(temperature=0, logprobs=1), "logprobs"),
             (SamplingParams(temperature=0, min_tokens=2), "min_tokens"),
             (SamplingParams(temperature=0, bad_words=["x"]), "bad_words"),
             (SamplingParams(temperature=0,
                             structured_outputs=StructuredOutputsParams(regex="a+")),
              "structured_outputs")]
    for params, parameter in cases:
        refused = request_refusal(MOVING, params)
        assert refused is not None and refused[0] == parameter, (parameter, refused)
        assert request_refusal(FIXED, params) is None


def test_families_declare_from_their_configuration():
    assert model_capabilities(SDARConfig()) == ModelCapabilities(family="SDAR")
    llada20 = model_capabilities(LLaDA2MoeConfig(vocab_size=64))
    assert not llada20.moves_tokens and not llada20.needs_whole_blocks
    llada22 = model_capabilities(LLaDA2MoeConfig(vocab_size=64, block_size=8,
                                                 expert_capacity=4, delete_token_id=60,
                                                 split_token_id=61))
    assert llada22.edit_tokens == (60, 61) and llada22.routing_block_size == 8
    assert llada22.option_defaults["strategy"] == "low_confidence_dynamic"
    with pytest.raises(ValueError, match="'split_token_id' in \\[0, 64\\)"):
        model_capabilities(LLaDA2MoeConfig(vocab_size=64, expert_capacity=4,
                                           delete_token_id=60, split_token_id=64))
    with pytest.raises(ValueError, match="must differ"):
        model_capabilities(LLaDA2MoeConfig(vocab_size=64, expert_capacity=4,
                                           delete_token_id=60, split_token_id=60))

    class Unknown:
        model_type = "unknown"

    with pytest.raises(ValueError, match="no model family for model_type 'unknown'"):
        model_capabilities(Unknown())


def test_a_checkpoint_declares_its_own_unmasking_defaults():
    """config.json 'diffusion_option_defaults' lies over the family's published settings
    and under the engine's options; the default model declares the threshold its measured
    grid chose (benchmarks/RESULTS.md)."""
    import json

    from vllm_diffusion.config import parse_engine_options
    from vllm_diffusion.default_model import embedded_model_path
    from vllm_diffusion.options import OptionError

    tuned = model_capabilities(SDARConfig(diffusion_option_defaults={"threshold": 0.7}))
    assert tuned.checkpoint_option_defaults == {"threshold": 0.7}

    def resolved(options, model=tuned):
        return parse_engine_options(options, config_block_size=4, config_mask_token_id=3,
                                    vocab_size=64, model=model).policy_config
    assert resolved({}).threshold == 0.7
    assert resolved({"threshold": 0.9}).threshold == 0.9  # the published loop's, asked for
    assert resolved({"diffusion_policy": "ada"})  # a policy without the option ignores it
    with pytest.raises(OptionError, match="'treshold' is no policy's option"):
        resolved({}, model_capabilities(SDARConfig(diffusion_option_defaults={
            "treshold": 0.7})))
    with pytest.raises(OptionError, match="diffusion_option_defaults.*threshold"):
        resolved({}, model_capabilities(SDARConfig(diffusion_option_defaults={
            "threshold": 1.5})))
    with pytest.raises(ValueError, match="must map option names to values"):
        model_capabilities(SDARConfig(diffusion_option_defaults=[0.7]))
    shipped = json.loads((embedded_model_path() / "config.json").read_text())
    assert shipped["diffusion_option_defaults"] == {"threshold": 0.7}


def test_declared_regimes_the_engine_does_not_serve_are_refused_by_name():
    assert model_refusal(FIXED) is None and model_refusal(MOVING) is None
    assert model_refusal(ModelCapabilities(family="F", attention="full")) is None
    assert "'sliding'" in model_refusal(ModelCapabilities(family="F", attention="sliding"))
    # under either regime the planner reads a block's logits one row earlier
    assert model_refusal(ModelCapabilities(family="F", shifted_logits=True)) is None
    assert model_refusal(ModelCapabilities(family="F", attention="full",
                                           shifted_logits=True)) is None
    assert "approximate" in model_refusal(ModelCapabilities(family="F", exact_kv=False))


def test_a_whole_canvas_family_refuses_a_canvas_larger_than_its_block():
    from vllm import SamplingParams

    whole = ModelCapabilities(family="Whole", attention="full", whole_canvas=True)
    assert request_refusal(whole, SamplingParams(max_tokens=16), block_size=16) is None
    parameter, why = request_refusal(whole, SamplingParams(max_tokens=17), block_size=16)
    assert parameter == "max_tokens" and "max_tokens (17)" in why
    assert "whole canvas" in why and "block size (16)" in why
    # an unset max_tokens is checked once vLLM resolved it (requests.validate_satisfiable)
    assert request_refusal(whole, SamplingParams(max_tokens=None), block_size=16) is None
    assert request_refusal(FIXED, SamplingParams(max_tokens=17), block_size=16) is None


def test_shifted_logits_take_the_policies_that_keep_the_row_before_each_position():
    shifted = ModelCapabilities(family="Shifted", shifted_logits=True)
    assert shifted.needs_whole_blocks
    # standard (its chunk window too), FOCUS, ES-dLLM and elastic keep the row before
    # every position they decode, whole block or not; Ada-DLM decodes whole blocks
    assert refusal(shifted, POLICIES["standard"], {}) is None
    assert refusal(shifted, POLICIES["ada"], {}) is None
    assert refusal(shifted, POLICIES["standard"], {"chunk_size": 2, "chunk_reuse": True}) is None
    for name in ("focus", "es", "elastic", "sparse_prefix"):
        assert refusal(shifted, POLICIES[name], {}) is None, name
    message = refusal(shifted, POLICIES["focus"], {"commit": "delayed"})
    assert message.startswith("the focus policy cannot serve Shifted: it computes whole "
                              "blocks only with its full budget"), message
    assert "Shifted's logits are shifted: each position's token is read from the row " \
           "before it" in message
    message = refusal(shifted, POLICIES["ada"], {"intra_block_cache": True})
    assert message.startswith("the ada policy cannot serve Shifted, whose logits are "
                              "shifted"), message
    assert "use the standard policy" in message


def test_fast_dllm_v2_declares_its_published_decoding():
    config = FastDLLMQwenConfig()  # published keys only: no mask id in config.json
    assert config.block_size == 32 and config.mask_token_id == 151665
    assert FastDLLMQwenConfig(bd_size=16).block_size == 16
    model = model_capabilities(config)
    assert model.family == "Fast-dLLM v2" and model.shifted_logits
    assert model.attention == "block_causal" and model.exact_kv
    assert dict(model.option_defaults) == {"strategy": "threshold", "threshold": 0.9,
                                           "sub_block_size": 8}
    assert refusal(model, POLICIES["standard"], dict(model.option_defaults),
                   block_size=32) is None
    assert refusal(model, POLICIES["ada"], {}) is None  # whole blocks
    assert refusal(model, POLICIES["ada"], {"intra_block_cache": True}).startswith(
        "the ada policy cannot serve Fast-dLLM v2, whose logits are shifted")
    assert refusal(model, POLICIES["sparse_prefix"], {}) is None  # whole blocks


def test_sparse_prefix_with_shifted_logits_is_served_block_causal_only():
    """Its shifted-logits form is the block-causal one (``test_sparse_shifted.py``); a
    full-attention model with shifted logits (Dream) is refused at start-up."""
    from vllm_diffusion.models.full_attention_configs import DreamConfig

    dream = DreamConfig(num_hidden_layers=2)
    policy = POLICIES["sparse_prefix"](32, 7, POLICIES["sparse_prefix"].config_cls())
    with pytest.raises(ValueError, match="the sparse_prefix policy cannot serve Dream: its "
                       "selection is served with shifted logits under block-causal"):
        policy.bind(model_capabilities(dream), dream, False)
    policy.bind(model_capabilities(FastDLLMQwenConfig(num_hidden_layers=2)),
                FastDLLMQwenConfig(num_hidden_layers=2), False)


def test_full_attention_cache_modes_of_the_seed_methods():
    """Sparse-dLLM and ES-dLLM act on the KV a cached step reads (the dual cache); Ada-DLM
    decides commits only, under any cache mode; FOCUS stays refused."""
    full = ModelCapabilities(family="Full", attention="full")
    for name in ("sparse_prefix", "es"):
        for mode in ("recompute", "prefix"):
            message = refusal(full, POLICIES[name], {}, cache_mode=mode)
            assert f"'diffusion_cache_mode' {mode!r}" in message, message
            assert "serve with 'diffusion_cache_mode' 'dual'" in message, message
        assert refusal(full, POLICIES[name], {}, cache_mode="dual") is None, name
    for mode in ("recompute", "prefix", "dual"):
        assert refusal(full, POLICIES["ada"], {}, cache_mode=mode) is None, mode
    assert "'intra_block_cache'" in refusal(full, POLICIES["ada"], {"intra_block_cache": True},
                                            cache_mode="dual")
    assert refusal(full, POLICIES["focus"], {}, cache_mode="dual") is not None
    # an unknown mode is left to the option's own check, which names it
    assert refusal(full, POLICIES["es"], {}, cache_mode="sideways") is None
    # Sparse-dLLM selects after the refresh: no delay is refused there, named
    message = refusal(full, POLICIES["sparse_prefix"], {"delay_steps": 0}, cache_mode="dual")
    assert "option 'delay_steps' 0" in message and message.endswith("set it to 1 or more")
    assert refusal(FIXED, POLICIES["sparse_prefix"], {"delay_steps": 0}) is None


def test_traits_read_options_as_their_rules_parse_them():
    """Start-up checks the options as given (strings from a command line included) before
    they are parsed: the traits parse what they read, and a bad value names its option."""
    from vllm_diffusion.options import OptionError

    full = ModelCapabilities(family="Full", attention="full")
    assert refusal(full, POLICIES["es"], {"skip_ratio": "0.3"}, cache_mode="dual") is None
    assert refusal(full, POLICIES["ada"], {"intra_block_cache": "false"}) is None
    assert "'intra_block_cache'" in refusal(full, POLICIES["ada"], {"intra_block_cache": "true"})
    assert refusal(full, POLICIES["sparse_prefix"], {"delay_steps": "0"},
                   cache_mode="dual") is not None
    with pytest.raises(OptionError, match="skip_ratio"):
        refusal(full, POLICIES["es"], {"skip_ratio": "many"}, cache_mode="dual")
