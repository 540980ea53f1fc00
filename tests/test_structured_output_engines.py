"""Structured output across engines: preemption mid-block, abort mid-block, and a
permissive grammar on a trained checkpoint (one engine at a time)."""

from __future__ import annotations

import pathlib
import random
import re

import pytest
from conftest import (
    assert_abort_mid_block_frees_kv,
    diffusion_llm,
    outputs_with_and_without_room,
)
from test_parity import checkpoint_info

from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.engine

TRAINED = pathlib.Path(__file__).resolve().parents[1] / "checkpoints/sdar-tiny-chat"
REGEX = "[a-e]{3}( [a-e]{2,4}){3,8}"


def test_preempted_requests_decode_as_with_room(dense_checkpoint):
    """The grammar's state is the emitted output and ``standard``'s block KV a function
    of its canvas, so preempted requests decode exactly as in an engine with room."""
    mask_id, stops, vocab_size = checkpoint_info(dense_checkpoint)
    rng = random.Random(3)
    allowed = [t for t in range(vocab_size) if t not in stops | {mask_id}]
    prompts = [TokensPrompt(prompt_token_ids=[rng.choice(allowed)
                                              for _ in range(rng.randint(5, 30))])
               for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(regex=REGEX))
    outputs, _ = outputs_with_and_without_room(dense_checkpoint, prompts, params)
    assert outputs[True] == outputs[False]


def test_abort_mid_block_frees_kv_and_a_permissive_grammar_changes_nothing():
    """On the trained tiny chat model: a request aborted mid-block leaves no KV held;
    with the ``sequential`` strategy a grammar that allows any text decodes token for
    token as without it."""
    with diffusion_llm(TRAINED, max_model_len=256) as llm:
        assert_abort_mid_block_frees_kv(llm, SamplingParams(
            temperature=0, max_tokens=40, extra_args={"strategy": "sequential"},
            structured_outputs=StructuredOutputsParams(regex=REGEX)))

        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 tokenize=False, add_generation_prompt=True)
                   for text in ("Tell a short story about a cat.",
                                "Write a compact JSON object with age: 7; name: Mia.")]
        sequential = {"strategy": "sequential"}
        free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40,
                                                    extra_args=sequential), use_tqdm=False)
        permissive = llm.generate(prompts, SamplingParams(
            temperature=0, max_tokens=40, extra_args=sequential,
            structured_outputs=StructuredOutputsParams(regex=r"[\s\S]*")), use_tqdm=False)
        for a, b in zip(free, permissive):
            assert list(b.outputs[0].token_ids) == list(a.outputs[0].token_ids)


def test_the_llguidance_backend_enforces_the_same_grammars(dense_checkpoint):
    """With ``--structured-outputs-config.backend guidance`` (llguidance, whose matcher
    rolls back with a lag after a stop token) the same grammars hold, greedy and sampled,
    one position or a whole block per step."""
    grammars = {"[a-c]{5}x": StructuredOutputsParams(regex="[a-c]{5}x"),
                "alpha|beta": StructuredOutputsParams(choice=["alpha", "beta"]),
                "the quick brown fox jumps": StructuredOutputsParams(
                    regex="the quick brown fox jumps")}
    with diffusion_llm(dense_checkpoint, diffusion_block_size=8, max_model_len=128,
                       structured_outputs_config={"backend": "guidance"}) as llm:
        for pattern, so in grammars.items():
            params = [SamplingParams(temperature=temperature, seed=seed, max_tokens=40,
                                     structured_outputs=so, extra_args=options)
                      for options in ({"strategy": "threshold", "threshold": 0.0},
                                      {"strategy": "sequential"})
                      for temperature, seed in ((0.0, None), (1.0, 3))]
            outputs = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])] * len(params),
                                   params, use_tqdm=False)
            for out in outputs:
                assert out.outputs[0].finish_reason == "stop"
                assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
