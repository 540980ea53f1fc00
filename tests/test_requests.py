"""Bad input gets a clear error, aborts free KV blocks, sampling honours its parameters."""

from __future__ import annotations

import json

import pytest
from conftest import assert_abort_mid_block_frees_kv, diffusion_llm

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt
from vllm.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.engine

REJECTED = (ValueError, VLLMValidationError)


@pytest.fixture(scope="module")
def llm(dense_checkpoint):
    with diffusion_llm(dense_checkpoint, diffusion_block_size=4, max_model_len=64) as engine:
        yield engine


def mask_id(checkpoint) -> int:
    return json.loads((checkpoint / "config.json").read_text())["mask_token_id"]


def generate(llm, prompt_ids, **params):
    return llm.generate(TokensPrompt(prompt_token_ids=prompt_ids),
                        SamplingParams(**params), use_tqdm=False)


def test_prompt_with_mask_token_is_rejected(llm, dense_checkpoint):
    with pytest.raises(REJECTED, match=r"mask token \(id \d+\) at position 2"):
        generate(llm, [5, 6, mask_id(dense_checkpoint), 7], temperature=0, max_tokens=4)


def test_empty_and_too_long_prompts_are_rejected(llm):
    with pytest.raises(REJECTED, match="cannot be empty"):
        generate(llm, [], temperature=0, max_tokens=4)
    with pytest.raises(REJECTED, match="maximum context length is 64"):
        generate(llm, [5] * 65, temperature=0, max_tokens=4)


def test_output_reaching_the_model_length_ends_there_as_in_stock_vllm(llm):
    """Prompt plus max_tokens over max_model_len (64) is not refused: as stock vLLM's
    scheduler does (``check_stop``), the output ends at the model length with
    finish_reason "length"; a non-finite logit_bias is refused naming its token."""
    for prompt_len, expected in ((61, 3), (63, 1)):
        (out,) = generate(llm, [5] * prompt_len, temperature=0, max_tokens=10,
                          ignore_eos=True)
        assert len(out.outputs[0].token_ids) == expected
        assert out.outputs[0].finish_reason == "length"
    with pytest.raises(REJECTED, match="got nan for token 42"):
        generate(llm, [5, 6, 7], max_tokens=4, logit_bias={5: 1.0, 42: float("nan")})


@pytest.mark.parametrize("params, name", [
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"structured_outputs": StructuredOutputsParams(regex="a+"), "logprobs": 1},
     "structured_outputs"),
])
def test_unsupported_sampling_parameters_are_rejected(llm, params, name):
    with pytest.raises(REJECTED, match=f"{name}(=.* is not supported by block-diffusion|: )"):
        generate(llm, [5, 6, 7], max_tokens=4, **params)


@pytest.mark.parametrize("extra_args, message", [
    ({"threshold": 1.5}, r"option 'threshold' must be float in \[0.0, 1.0\], got 1.5"),
    ({"threshold": True}, r"option 'threshold' must be float in \[0.0, 1.0\], got True"),
    ({"strategy": "fastest"}, r"option 'strategy' must be one of 'low_confidence_dynamic'"),
    ({"denoising_steps": 9}, r"'denoising_steps' must be at most the block size \(4\)"),
    ({"thresold": 0.5}, r"unknown option\(s\) 'thresold'; valid options"),
    ({"diffusion_policy": "focus"}, r"per-request policy switching is not supported"),
])
def test_invalid_request_options_name_the_option(llm, extra_args, message):
    with pytest.raises(REJECTED, match=message):
        generate(llm, [5, 6, 7], temperature=0, max_tokens=4, extra_args=extra_args)
    # The engine keeps serving after a rejected request.
    assert len(generate(llm, [5, 6, 7], temperature=0, max_tokens=4)[0].outputs[0].token_ids) == 4


def test_abort_mid_block_frees_kv_blocks(llm):
    assert_abort_mid_block_frees_kv(llm, SamplingParams(
        temperature=0, max_tokens=40, extra_args={"strategy": "sequential"}))


def test_seeded_sampling_is_reproducible_and_never_emits_the_mask(llm, dense_checkpoint):
    prompt = list(range(5, 15))
    runs = [generate(llm, prompt, temperature=1.5, top_k=50, top_p=0.9, seed=seed,
                     max_tokens=24)[0].outputs[0].token_ids for seed in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    for run in runs:
        assert mask_id(dense_checkpoint) not in run


def test_engine_options_are_validated_at_start_up(dense_checkpoint):
    with pytest.raises(REJECTED, match="unknown diffusion policy 'fastest'; valid policies"):
        with diffusion_llm(dense_checkpoint, additional_config={"diffusion_policy": "fastest"}):
            pass
    with pytest.raises(REJECTED, match="unknown option.*'treshold'"):
        with diffusion_llm(dense_checkpoint, additional_config={"treshold": 0.5}):
            pass
    with pytest.raises(REJECTED, match="must be a multiple of the diffusion block size"):
        with diffusion_llm(dense_checkpoint, diffusion_block_size=8, max_model_len=100):
            pass


def test_kv_page_size_must_hold_whole_diffusion_blocks(dense_checkpoint):
    with pytest.raises(Exception, match=r"KV page size .* must be a multiple of the diffusion"):
        with diffusion_llm(dense_checkpoint, diffusion_block_size=32, block_size=16):
            pass


def test_allowed_token_ids_and_logit_bias_hold_at_every_position(llm, dense_checkpoint):
    """Every generated token is among allowed_token_ids (greedy and sampled, n = 2); a
    large logit_bias makes every greedy position propose its token; a list holding only
    the mask token is refused naming the parameter."""
    allowed = [11, 12, 13, 40]
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=[5, 6, 7]), TokensPrompt(prompt_token_ids=[8, 9])],
        [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                        allowed_token_ids=allowed),
         SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=10, ignore_eos=True,
                        allowed_token_ids=allowed)], use_tqdm=False)
    generated = [c.token_ids for o in outputs for c in o.outputs]
    assert len(generated) == 3 and all(len(t) == 10 for t in generated)
    assert all(set(t) <= set(allowed) for t in generated)
    (biased,) = generate(llm, [5, 6, 7], temperature=0, max_tokens=9, ignore_eos=True,
                         logit_bias={21: 100.0})
    assert list(biased.outputs[0].token_ids) == [21] * 9
    with pytest.raises(REJECTED, match="allowed_token_ids holds only the mask token"):
        generate(llm, [5, 6, 7], temperature=0, max_tokens=4,
                 allowed_token_ids=[mask_id(dense_checkpoint)])


def test_min_tokens_bars_stop_tokens_before_the_minimum(llm):
    """A stop token pushed to the top of every position (logit_bias) ends the output right
    at min_tokens: no position before the minimum proposes it, the first one at it does."""
    stop = llm.llm_engine.tokenizer.eos_token_id
    for minimum in (0, 6, 9):
        (out,) = generate(llm, [5, 6, 7], temperature=0, max_tokens=20, min_tokens=minimum,
                          logit_bias={stop: 100.0})
        tokens = list(out.outputs[0].token_ids)
        assert out.outputs[0].finish_reason == "stop"
        assert stop not in tokens[:minimum] and len(tokens) == minimum + 1, (minimum, tokens)


def test_repetition_penalty_keeps_sequential_decoding_from_repeating(llm):
    """One token per step (``sequential``), so each position's penalty sees every token
    before it: with a strong repetition penalty no output token repeats one of the prompt
    or an earlier output token; without it the same request repeats."""
    prompt = [5, 6, 7, 8]
    options = {"strategy": "sequential"}
    (plain,) = generate(llm, prompt, temperature=0, max_tokens=16, ignore_eos=True,
                        extra_args=options)
    (penalised,) = generate(llm, prompt, temperature=0, max_tokens=16, ignore_eos=True,
                            repetition_penalty=50.0, extra_args=options)
    tokens = list(penalised.outputs[0].token_ids)
    assert len(set(tokens)) == 16 and not set(tokens) & set(prompt)
    assert len(set(plain.outputs[0].token_ids) | set(prompt)) < 20


def test_entropy_bounded_unmasking(llm):
    """The EB-sampler strategy: with a zero bound it commits one position per step: the
    masked one of lowest entropy by default (each commit checked against its step's
    entropies), the most confident with ``entropy_bounded_order`` ``confidence``, which is
    exactly ``low_confidence_static`` at one token per step; with a bound no block
    reaches it commits every masked position at once; the options are validated."""
    import torch

    from vllm_diffusion_lab.offline import stats_delta

    prompts = [TokensPrompt(prompt_token_ids=p) for p in ([5, 6, 7], [8, 9, 10, 11, 12])]
    policy = (llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
              .worker.model_runner.policy)
    decide = policy.decide
    decisions = []

    def recording_decision(blocks):
        decision = decide(blocks)
        decisions.append((blocks.available.clone(), blocks.entropy.clone(),
                          decision.commits.clone()))
        return decision

    def run(options):
        before = llm.collective_rpc("diffusion_stats")[0]
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                       ignore_eos=True, extra_args=options),
                               use_tqdm=False)
        stats = stats_delta(before, llm.collective_rpc("diffusion_stats")[0])
        return [list(o.outputs[0].token_ids) for o in outputs], stats

    policy.decide = recording_decision
    try:
        _, narrow_stats = run({"strategy": "entropy_bounded", "entropy_bound": 0.0})
    finally:
        del policy.decide  # the class's method again
    committed = 0
    for masked, entropy, commits in decisions:
        for row in range(len(masked)):
            if bool(masked[row].any()):
                lowest = int(torch.where(masked[row], entropy[row], float("inf")).argmin())
                assert commits[row].nonzero().flatten().tolist() == [lowest]
                committed += 1
    assert committed >= 2 * 12  # every output position of both requests was checked
    by_confidence, _ = run({"strategy": "entropy_bounded", "entropy_bound": 0.0,
                            "entropy_bounded_order": "confidence"})
    static, _ = run({"strategy": "low_confidence_static"})
    assert by_confidence == static
    _, wide_stats = run({"strategy": "entropy_bounded", "entropy_bound": 1e6})
    assert wide_stats["denoising_steps_per_block"] == 1.0
    assert narrow_stats["denoising_steps_per_block"] > 1.0
    with pytest.raises(REJECTED, match=r"option 'entropy_bound' must be float in \[0.0"):
        generate(llm, [5, 6, 7], max_tokens=4, extra_args={"strategy": "entropy_bounded",
                                                           "entropy_bound": -1.0})
    with pytest.raises(REJECTED, match="option 'entropy_bounded_order' must be one of "
                                       "'entropy', 'confidence', got 'margin'"):
        generate(llm, [5, 6, 7], max_tokens=4, extra_args={"strategy": "entropy_bounded",
                                                           "entropy_bounded_order": "margin"})


def test_the_rewriting_loops_step_cap_is_refused_for_models_with_fixed_positions(llm):
    with pytest.raises(REJECTED, match="option 'max_steps_per_block' applies to decoding "
                       "whose edits move tokens within a block; SDAR does not"):
        generate(llm, [5, 6, 7], temperature=0, max_tokens=4,
                 extra_args={"max_steps_per_block": 10})
