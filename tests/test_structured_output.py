"""Structured output in block decoding (``worker/grammar.py``): every output the grammar
finishes follows it, forced tokens are filled at once, the greedy engine equals the plain
reference of the rule, and what cannot be honoured is refused."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from conftest import diffusion_llm
from reference_grammar import reference_grammar_generate
from reference_sdar import ReferenceSDAR
from test_parity import checkpoint_info

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt
from vllm.sampling_params import StructuredOutputsParams

from vllm_diffusion_lab.offline import stats_delta

pytestmark = pytest.mark.engine

BLOCK_SIZE = 8
REJECTED = (ValueError, VLLMValidationError)
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"},
                                           "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["id", "tag"], "additionalProperties": False}
# (name, structured outputs, check of a finished text)
GRAMMARS = {
    "regex": (StructuredOutputsParams(regex="[a-c]{5}x"),
              lambda t: re.fullmatch("[a-c]{5}x", t)),
    "choice": (StructuredOutputsParams(choice=["alpha", "beta", "gamma"]),
               lambda t: t in ("alpha", "beta", "gamma")),
    "json": (StructuredOutputsParams(json=SCHEMA),
             lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
}
STRATEGIES = [{"strategy": "low_confidence_dynamic"}, {"strategy": "threshold", "threshold": 0.0},
              {"strategy": "sequential"}, {"strategy": "entropy_bounded"}]


@pytest.fixture(scope="module")
def llm(dense_checkpoint):
    with diffusion_llm(dense_checkpoint, diffusion_block_size=BLOCK_SIZE,
                       max_model_len=256) as engine:
        yield engine


def generate(llm, prompts, params):
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)


@pytest.mark.parametrize("name", GRAMMARS)
def test_finished_outputs_follow_the_grammar_over_strategies_temperatures_and_seeds(llm, name):
    """One batch: the grammar under four strategies, greedy and sampled with three seeds
    each, with n = 2, prompts shorter than a block, one block and longer; every output
    that stops follows the grammar, none ends in an error, regex and choice all stop."""
    so, check = GRAMMARS[name]
    params, prompts = [], []
    for options in STRATEGIES:
        for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)):
            for prompt in ([5, 6, 7], list(range(10, 18)), list(range(20, 39))):
                prompts.append(prompt)
                params.append(SamplingParams(temperature=temperature, seed=seed,
                                             n=2 if seed == 1 else 1, max_tokens=48,
                                             structured_outputs=so, extra_args=options))
    outputs = generate(llm, prompts, params)
    finished = [c for o in outputs for c in o.outputs]
    assert all(c.finish_reason in ("stop", "length") for c in finished)
    stopped = [c for c in finished if c.finish_reason == "stop"]
    assert all(check(c.text) for c in stopped), [c.text for c in stopped if not check(c.text)]
    if name != "json":  # the random model can wander in JSON whitespace up to max_tokens
        assert len(stopped) == len(finished)
    else:
        assert stopped


def test_a_forced_constant_is_filled_at_once(llm):
    """A grammar that forces a long constant: the text is the constant and each block
    fills in one step (the forced tokens need no confidence), whatever the model
    proposes."""
    constant = "the quick brown fox jumps over the lazy dog and the cat"
    before = llm.collective_rpc("diffusion_stats")[0]
    (out,) = generate(llm, [[5, 6, 7]], SamplingParams(
        temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(
            regex=re.escape(constant))))
    stats = stats_delta(before, llm.collective_rpc("diffusion_stats")[0])
    assert out.outputs[0].text == constant and out.outputs[0].finish_reason == "stop"
    # one step per block, and one more for the stop token
    blocks = -(-(3 + len(out.outputs[0].token_ids)) // BLOCK_SIZE)
    assert stats["denoising_steps"] <= blocks + 1
    assert stats["grammar_fills"] > 0 and stats["grammar_accepts"] > 0


def test_grammar_complete_mid_block_limits_and_stop_strings(llm):
    """The grammar completing mid-block ends the request with a stop token; with
    ignore_eos the request goes on unconstrained to max_tokens without an error;
    max_tokens inside the object finishes with length; a stop string inside the structure
    cuts it as vLLM does."""
    so = StructuredOutputsParams(regex="ab")
    done, free, cut, stopped = generate(llm, [[5, 6, 7]] * 4, [
        SamplingParams(temperature=0, max_tokens=20, structured_outputs=so),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, structured_outputs=so),
        SamplingParams(temperature=0, max_tokens=3, structured_outputs=GRAMMARS["json"][0]),
        SamplingParams(temperature=0, max_tokens=20, stop=["-"],
                       structured_outputs=StructuredOutputsParams(regex="xyz-[0-9]{3}"))])
    assert done.outputs[0].text == "ab" and done.outputs[0].finish_reason == "stop"
    assert free.outputs[0].text.startswith("ab") and len(free.outputs[0].token_ids) == 20
    assert free.outputs[0].finish_reason == "length"
    assert cut.outputs[0].finish_reason == "length" and len(cut.outputs[0].token_ids) == 3
    assert stopped.outputs[0].text == "xyz" and stopped.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("strategy", ["low_confidence_dynamic", "threshold"])
def test_greedy_output_equals_the_reference_rule(llm, dense_checkpoint, strategy):
    mask_id, stops, vocab_size = checkpoint_info(dense_checkpoint)
    reference = ReferenceSDAR(dense_checkpoint)
    regex = "[a-e]{3}( [a-e]{2,4}){2,5}"
    prompts = [[5, 6, 7], list(range(10, 18)), list(range(20, 31))]
    options = {"strategy": strategy, "threshold": 0.5}
    outputs = generate(llm, prompts, SamplingParams(
        temperature=0, max_tokens=40, extra_args=options,
        structured_outputs=StructuredOutputsParams(regex=regex)))
    for prompt, out in zip(prompts, outputs):
        want = reference_grammar_generate(
            reference, llm.get_tokenizer(), prompt, regex=regex, block_size=BLOCK_SIZE,
            mask_id=mask_id, vocab_size=vocab_size, max_tokens=40, stop_token_ids=stops,
            **options)
        assert list(out.outputs[0].token_ids) == want


def test_what_cannot_be_honoured_is_refused(llm, dense_checkpoint):
    so = StructuredOutputsParams(regex="a+")
    with pytest.raises(REJECTED, match="structured_outputs: logprobs"):
        generate(llm, [[5, 6]], SamplingParams(max_tokens=4, logprobs=1,
                                               structured_outputs=so))
    with pytest.raises(REJECTED, match="editing_threshold"):
        generate(llm, [[5, 6]], SamplingParams(max_tokens=4, structured_outputs=so,
                                               extra_args={"editing_threshold": 0.9}))
    with pytest.raises(REJECTED):  # vLLM's own validation of the schema
        generate(llm, [[5, 6]], SamplingParams(max_tokens=4, structured_outputs=(
            StructuredOutputsParams(json={"type": "no-such-type"}))))
    assert len(generate(llm, [[5, 6, 7]], SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids) == 4
