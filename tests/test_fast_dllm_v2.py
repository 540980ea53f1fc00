"""Fast-dLLM v2 through the engine: greedy output equal to the published ``generate``
(``reference_fast_dllm_v2``, importing no package code) token for token on a named grid --
block-causal attention with each position read from the row before it, sub-blocks
decoded left to right with threshold commits, a block's first token from the previous
block's last row at its commit -- for prompts shorter than a block, of exactly one and two
blocks (the first token by the autoregressive step) and ending inside the second block,
alone and in one batch mixing all of them; a stop token; a chat through ``LLM.chat`` and
``vllm serve``; preemption and abort; tensor parallelism 2; sampling as the published
``sample_with_top_p`` (a tiny top_p; each block's first token the argmax at any
temperature); a chunk served and a sub-block size that does not divide the block refused
(the policies that cannot decode it are refused at start-up, ``test_capabilities``). The block cache: ``test_sub_block_cache``.

One engine serves every test: the checkpoint's ``bd_size`` 16 with the family's default
sub-blocks of 8 (two per block), a grid of request options around them."""

from __future__ import annotations

import json
import pathlib

import pytest

from conftest import (assert_abort_mid_block_frees_kv, diffusion_llm, token_prompts,
                      watch_preemptions)
from reference_fast_dllm_v2 import ReferenceFastDLLMv2, reference_generate
from test_faults import REJECTED

from vllm_diffusion_lab.fixtures.tiny_fast_dllm_v2 import build_tiny_fast_dllm_v2

pytestmark = pytest.mark.engine

BLOCK_SIZE = 16
MAX_TOKENS = 40
# shorter than a block, exactly one and two blocks, ending inside the second block
PROMPTS = {"short": [11, 12, 13, 14, 15], "one-block": list(range(40, 56)),
           "two-blocks": list(range(100, 132)), "tail": list(range(60, 81))}
# (sub_block_size, threshold; None: the family's defaults, 8 and 0.9)
CASES = {"published": (None, None), "sub4-threshold0.3": (4, 0.3),
         "sub16-threshold0.3": (16, 0.3), "sub8-threshold0.05": (8, 0.05)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> pathlib.Path:
    return build_tiny_fast_dllm_v2(tmp_path_factory.mktemp("fast-dllm-v2"),
                                   bd_size=BLOCK_SIZE)


@pytest.fixture(scope="module")
def reference(checkpoint):
    mask_id = json.loads((checkpoint / "config.json").read_text())["mask_token_id"]
    return ReferenceFastDLLMv2(checkpoint), mask_id


@pytest.fixture(scope="module")
def llm(checkpoint):
    with diffusion_llm(checkpoint, max_num_seqs=8) as engine:
        yield engine


def greedy(case: str, stop: int | None = None):
    from vllm import SamplingParams

    sub_block, threshold = CASES[case]
    extra = {} if sub_block is None else {"sub_block_size": sub_block,
                                          "threshold": threshold}
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                          stop_token_ids=None if stop is None else [stop],
                          extra_args=extra)


def published(reference, prompt: list[int], case: str, stop: int | None = None) -> list[int]:
    model, mask_id = reference
    sub_block, threshold = CASES[case]
    out = reference_generate(model, prompt, mask_id=mask_id,
                             max_new_tokens=(MAX_TOKENS // BLOCK_SIZE + 2) * BLOCK_SIZE,
                             block_size=BLOCK_SIZE, small_block_size=sub_block or 8,
                             threshold=0.9 if threshold is None else threshold,
                             stop_token=stop)
    return out[:MAX_TOKENS]


def test_greedy_equals_the_published_loop(llm, reference):
    """Each case and prompt alone, then all of them in one batch."""
    cases = [(case, name) for case in CASES for name in PROMPTS]
    want = {key: published(reference, PROMPTS[key[1]], key[0]) for key in cases}
    assert len({tuple(v) for v in want.values()}) > len(PROMPTS)  # the cases differ
    for case, name in cases:
        alone = llm.generate(token_prompts([PROMPTS[name]]), greedy(case),
                             use_tqdm=False)[0].outputs[0]
        assert list(alone.token_ids) == want[case, name], (case, name)
    batch = llm.generate(token_prompts([PROMPTS[name] for _, name in cases]),
                         [greedy(case) for case, _ in cases], use_tqdm=False)
    for key, output in zip(cases, batch):
        assert list(output.outputs[0].token_ids) == want[key], key


def test_a_stop_token_ends_the_output_where_the_published_loop_stops(llm, reference):
    """The published stop: the first stop token with everything before it decided; the
    stop token is a frequent one of each unstopped output, so the runs stop early."""
    for name, prompt in PROMPTS.items():
        free = published(reference, prompt, "published")
        stop = max(set(free[1:]), key=free[1:].count)
        want = published(reference, prompt, "published", stop)
        assert want[-1] == stop and len(want) < MAX_TOKENS, (name, want)
        got = llm.generate(token_prompts([prompt]), greedy("published", stop),
                           use_tqdm=False)[0].outputs[0]
        assert list(got.token_ids) == want, name


def test_a_chunk_is_served_and_a_sub_block_that_does_not_divide_the_block_refused(llm):
    """Chunks decode as ``tests/test_chunked_shifted.py`` checks against its reference."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                            extra_args={"chunk_size": 4})
    out = llm.generate(token_prompts([PROMPTS["short"]]), params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    bad = SamplingParams(temperature=0.0, max_tokens=8, extra_args={"sub_block_size": 5})
    with pytest.raises(REJECTED, match=r"option 'sub_block_size' must divide the block "
                                       r"size \(16\), got 5"):
        llm.generate(token_prompts([PROMPTS["short"]]), bad, use_tqdm=False)


def test_chat_equals_the_published_loop_on_the_templated_prompt(checkpoint, llm, reference,
                                                               tmp_path):
    """``LLM.chat`` through the checkpoint's ChatML template (Qwen2.5's format): the answer
    is the published loop's on the templated prompt (its ``stop_token`` ``<|im_end|>``),
    up to the first of the generation config's EOS ids, where the engine stops; ``vllm
    serve`` answers the same, streamed and not."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_diffusion_lab.fixtures.server import chat_contents, vllm_server

    messages = [{"role": "user", "content": "What is 12 plus 7?"}]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    stops = json.loads((checkpoint / "generation_config.json").read_text())["eos_token_id"]
    model, mask_id = reference
    answer = reference_generate(model, prompt, mask_id=mask_id,
                                max_new_tokens=(MAX_TOKENS // BLOCK_SIZE + 2) * BLOCK_SIZE,
                                block_size=BLOCK_SIZE, stop_token=stops[0])[:MAX_TOKENS]
    ends = [i for i, token in enumerate(answer) if token in stops]
    want = answer[:ends[0] + 1] if ends else answer
    chat = llm.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                    use_tqdm=False)[0].outputs[0]
    assert list(chat.token_ids) == want and chat.text
    body = {"model": str(checkpoint), "temperature": 0, "max_tokens": MAX_TOKENS,
            "messages": messages}
    with vllm_server(checkpoint, "--max-model-len", "512", "--max-num-seqs", "2",
                     "--enforce-eager", log_path=tmp_path / "serve.log") as url:
        assert chat_contents(url, body) == (chat.text, chat.text)


def test_sampling_with_a_tiny_top_p_equals_the_published_sampler(llm, reference):
    """At temperature > 0 the published ``sample_with_top_p``: the softmax of the scaled
    logits cut to ``top_p`` and renormalised, a token drawn, its probability there the
    confidence. A tiny top_p leaves one token per position with confidence 1, so every
    sub-block is committed in one step: outputs and rows equal the reference's (greedy
    decoding with the raw probabilities takes more steps here)."""
    import torch
    from vllm import SamplingParams

    from vllm_diffusion_lab.offline import stats_delta

    model, mask_id = reference
    for name, prompt in PROMPTS.items():
        max_tokens = 2 * BLOCK_SIZE - len(prompt) % BLOCK_SIZE
        rows: list[int] = []
        want = reference_generate(model, prompt, mask_id=mask_id,
                                  max_new_tokens=2 * BLOCK_SIZE, block_size=BLOCK_SIZE,
                                  small_block_size=4, temperature=0.8, top_p=1e-6,
                                  generator=torch.Generator().manual_seed(0), rows=rows)
        params = SamplingParams(temperature=0.8, top_p=1e-6, seed=0, max_tokens=max_tokens,
                                ignore_eos=True, extra_args={"sub_block_size": 4})
        before = llm.collective_rpc("diffusion_stats")[0]
        out = llm.generate(token_prompts([prompt]), params, use_tqdm=False)[0].outputs[0]
        stats = stats_delta(before, llm.collective_rpc("diffusion_stats")[0])
        assert list(out.token_ids) == want[:max_tokens], name
        assert stats["positions_computed"] == sum(rows) - BLOCK_SIZE, name
        assert stats["denoising_steps"] < max_tokens, name


def test_each_block_first_token_is_the_argmax_at_any_temperature(llm, reference):
    """The published loop reads a block's first token at the previous block's commit by
    argmax, whatever the temperature; the engine's sampled requests do too (the other
    positions are drawn). At temperature 2 a drawn first token would rarely be the argmax
    (the chance of all of them is checked to be small)."""
    from vllm import SamplingParams

    from reference_fast_dllm_v2 import mask_banned

    model, mask_id = reference
    params = SamplingParams(temperature=2.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(token_prompts(list(PROMPTS.values())), params, use_tqdm=False)
    chance, sampled = 1.0, 0
    for (name, prompt), output in zip(PROMPTS.items(), outputs):
        tokens = prompt + list(output.outputs[0].token_ids)
        greedy_out = published(reference, prompt, "published")
        sampled += tokens[len(prompt):] != greedy_out
        for start in range(BLOCK_SIZE, len(tokens), BLOCK_SIZE):
            if start < len(prompt):
                continue
            logits, _ = model(tokens[:start], None, BLOCK_SIZE, update=False)
            last = mask_banned(logits[-1], mask_id)
            assert tokens[start] == int(last.argmax()), (name, start)
            chance *= float((last / 2.0).softmax(dim=-1).max())
    assert sampled and chance < 0.01, (sampled, chance)


def test_logprobs_and_grammars_are_served_as_for_sdar(llm, reference):
    """The engine's generic paths with this family's shifted reads: greedy logprobs rank
    every output token first (each block's first token included, read at the previous
    block's commit) without changing the output; a regex and a choice grammar stop with
    tokens that follow them, under the family's sub-blocks and threshold (the tokens are
    decoded alone: the prompts' byte tokens would prefix the text with partial
    characters)."""
    import re

    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    prompts = list(PROMPTS.values())
    plain = llm.generate(token_prompts(prompts), greedy("published"), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=2)
    outputs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    for want, got in zip(plain, outputs):
        out = got.outputs[0]
        assert list(out.token_ids) == list(want.outputs[0].token_ids)
        assert len(out.logprobs) == len(out.token_ids)
        for token, entry in zip(out.token_ids, out.logprobs):
            assert entry[token].rank == 1, (token, entry)
    grammars = {"[a-c]{5}x": StructuredOutputsParams(regex="[a-c]{5}x"),
                "alpha|beta|gamma": StructuredOutputsParams(choice=["alpha", "beta", "gamma"])}
    tokenizer = llm.get_tokenizer()
    for pattern, so in grammars.items():
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=so)
        for output in llm.generate(token_prompts(prompts), params, use_tqdm=False):
            out = output.outputs[0]
            text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
            assert out.finish_reason == "stop" and re.fullmatch(pattern, text), text


def test_tensor_parallel_equals_the_published_loop(checkpoint, reference, two_cpu_ranks):
    """Two ranks on CPU (gloo): vLLM shards the Qwen2 heads (4 query, 2 KV), QKV biases
    and MLP; the outputs equal the single-process published loop."""
    cases = [(case, name) for case in ("published", "sub4-threshold0.3")
             for name in ("short", "two-blocks", "tail")]
    with diffusion_llm(checkpoint, max_num_seqs=8, max_model_len=128,
                       tensor_parallel_size=2, distributed_executor_backend="mp") as engine:
        outputs = engine.generate(token_prompts([PROMPTS[name] for _, name in cases]),
                                  [greedy(case) for case, _ in cases], use_tqdm=False)
    for (case, name), output in zip(cases, outputs):
        assert list(output.outputs[0].token_ids) == published(
            reference, PROMPTS[name], case), (case, name)


def test_preempted_requests_decode_as_published_and_aborts_free_kv(checkpoint, reference):
    """With pages for fewer requests than run, the scheduler preempts and resumes requests
    (their blocks' KV recomputed, or read from the prefix cache); outputs stay the
    published loop's. A request aborted mid-block gives its pages back."""
    cases = [(case, name) for case in ("published", "sub4-threshold0.3") for name in PROMPTS]
    with diffusion_llm(checkpoint, max_num_seqs=8, block_size=16, max_model_len=96,
                       num_gpu_blocks_override=10) as engine:
        preempted = watch_preemptions(engine)
        outputs = engine.generate(token_prompts([PROMPTS[name] for _, name in cases]),
                                  [greedy(case) for case, _ in cases], use_tqdm=False)
        assert preempted, "no request was preempted; the test does not cover preemption"
        assert_abort_mid_block_frees_kv(engine, greedy("published").clone())
    for (case, name), output in zip(cases, outputs):
        assert list(output.outputs[0].token_ids) == published(
            reference, PROMPTS[name], case), (case, name)

