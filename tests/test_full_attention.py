"""LLaDA 1.x through the engine: greedy output equal to the published ``generate.py`` loop
(``reference_llada``, importing no package code) token for token on a named grid, a batch
mixing prompts shorter and longer than a block, the canvas sliding past
``diffusion_canvas_tokens``, stops, preemption and abort."""

from __future__ import annotations

import pathlib

import pytest

from conftest import (assert_abort_mid_block_frees_kv, assert_batched_and_alone, diffusion_llm,
                      token_prompts, watch_preemptions)
from reference_llada import ReferenceLLaDA, reference_generate

from vllm_diffusion_lab.fixtures.tiny_llada import build_tiny_llada

pytestmark = pytest.mark.engine

# prompts shorter than a block, about a block, and longer than two
PROMPTS = {"short": [11, 12, 13], "block": [20, 21, 22, 23, 24, 25, 26],
           "long": list(range(40, 59))}
# (block size, gen_length, steps per block): one token per step, and two per step
GRID = [(4, 8, 4), (4, 16, 2), (8, 16, 8), (8, 24, 4)]


@pytest.fixture(scope="module")
def llada_checkpoint(tmp_path_factory) -> pathlib.Path:
    return build_tiny_llada(tmp_path_factory.mktemp("llada-engine"), num_layers=2,
                            hidden_size=64, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def reference(llada_checkpoint):
    import json

    mask_id = json.loads((llada_checkpoint / "config.json").read_text())["mask_token_id"]
    return ReferenceLLaDA(llada_checkpoint), mask_id


def greedy(max_tokens: int, **extra):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args=extra or None)


def published(reference, prompt, block, gen_length, steps_per_block):
    model, mask_id = reference
    return reference_generate(model, prompt, mask_id=mask_id, gen_length=gen_length,
                              block_length=block,
                              steps=steps_per_block * (gen_length // block))


@pytest.mark.parametrize("block", [4, 8])
def test_greedy_equals_the_published_loop(llada_checkpoint, reference, block):
    """Each grid point of the block size: every prompt alone and all of them in one batch
    (requests of different prompt and canvas lengths)."""
    cases = [(b, g, s) for b, g, s in GRID if b == block]
    with diffusion_llm(llada_checkpoint, diffusion_block_size=block, max_num_seqs=4) as llm:
        for _, gen_length, steps in cases:
            params = greedy(gen_length, denoising_steps=steps)
            want = {name: published(reference, p, block, gen_length, steps)
                    for name, p in PROMPTS.items()}
            assert_batched_and_alone(llm, PROMPTS, params, want, "short", gen_length)


def test_output_ends_at_the_first_stop_token(llada_checkpoint, reference):
    """A stop token in the published canvas ends the output there (the loop decodes the
    whole canvas and callers cut at the first stop)."""
    from vllm import SamplingParams

    prompt, block, gen_length = PROMPTS["long"], 4, 16
    canvas = published(reference, prompt, block, gen_length, block)
    stop = canvas[5]
    want = canvas[:canvas.index(stop) + 1]
    with diffusion_llm(llada_checkpoint, diffusion_block_size=block, max_num_seqs=2) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=gen_length, stop_token_ids=[stop])
        output = llm.generate(token_prompts([prompt]), params, use_tqdm=False)[0].outputs[0]
    assert list(output.token_ids) == want


def test_the_canvas_slides_past_its_reach(llada_checkpoint, reference):
    """With ``diffusion_canvas_tokens`` as large as the output, the published loop; with a
    smaller one, the first block still sees the published canvas's first part only, so a
    longer output is decoded block by block (a documented deviation) and finishes."""
    block, gen_length = 4, 16
    with diffusion_llm(llada_checkpoint, diffusion_block_size=block, max_num_seqs=2,
                       additional_config={"diffusion_canvas_tokens": 8}) as llm:
        output = llm.generate(token_prompts([PROMPTS["block"]]), greedy(gen_length),
                              use_tqdm=False)[0].outputs[0]
    assert len(output.token_ids) == gen_length
    # the first block's steps saw the prompt and 8 positions: as the published loop on a
    # canvas of 8 for its first block
    first = published(reference, PROMPTS["block"], block, 8, block)[:block]
    assert list(output.token_ids[:block]) == first


def test_preemption_and_abort_free_kv_and_keep_outputs(llada_checkpoint):
    """A sliding canvas of 8 grows a request's pages block by block, so an engine short of
    pages preempts; its outputs equal those of an engine with room. An aborted request
    gives its pages back."""
    prompts = [PROMPTS["long"], PROMPTS["block"], PROMPTS["short"], [30, 31, 32, 33, 34]]
    outputs, preempted = {}, []
    for tight in (False, True):
        room = {"num_gpu_blocks_override": 5} if tight else {}
        with diffusion_llm(llada_checkpoint, diffusion_block_size=4, block_size=16,
                           max_model_len=48, max_num_seqs=4, **room,
                           additional_config={"diffusion_canvas_tokens": 8}) as llm:
            watched = watch_preemptions(llm)
            outputs[tight] = [list(o.outputs[0].token_ids) for o in llm.generate(
                token_prompts(prompts), greedy(20), use_tqdm=False)]
            if tight:
                preempted = watched
                assert_abort_mid_block_frees_kv(llm, greedy(16, strategy="sequential"))
    assert preempted, "no request was preempted; the test does not cover preemption"
    assert outputs[True] == outputs[False]


def test_tensor_parallel_equals_the_published_loop(llada_checkpoint, reference, two_cpu_ranks):
    """Two ranks on CPU (gloo): vLLM shards LLaDA's heads and MLP; the outputs equal the
    single-process published loop."""
    block, gen_length = 4, 12
    with diffusion_llm(llada_checkpoint, diffusion_block_size=block, max_num_seqs=4,
                       max_model_len=64, tensor_parallel_size=2,
                       distributed_executor_backend="mp") as llm:
        outputs = llm.generate(token_prompts(PROMPTS.values()), greedy(gen_length),
                               use_tqdm=False)
    for prompt, output in zip(PROMPTS.values(), outputs):
        assert list(output.outputs[0].token_ids) == published(reference, prompt, block,
                                                               gen_length, block)


EMBEDDED = pathlib.Path(__file__).resolve().parents[1] / "checkpoints/llada-small-chat"


def test_served_by_vllm_serve_with_its_chat_template(tmp_path):
    """The embedded LLaDA chat model through ``vllm serve``: a chat completion (its chat
    template) equals the ``LLM`` API's greedy chat answer, streamed and not."""
    import requests

    from vllm import SamplingParams
    from vllm_diffusion_lab.fixtures.server import vllm_server

    messages = [{"role": "user", "content": "What is 12 plus 7?"}]
    with diffusion_llm(EMBEDDED, max_model_len=512, max_num_seqs=2) as llm:
        want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=64),
                        use_tqdm=False)[0].outputs[0].text
    assert want.strip()
    body = {"model": str(EMBEDDED), "temperature": 0, "max_tokens": 64, "messages": messages}
    with vllm_server(EMBEDDED, "--max-model-len", "512", "--max-num-seqs", "2",
                     "--enforce-eager", log_path=tmp_path / "serve.log") as url:
        answer = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        assert answer["choices"][0]["message"]["content"] == want
        streamed = []
        with requests.post(f"{url}/v1/chat/completions", json={**body, "stream": True},
                           stream=True, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    import json

                    choice = json.loads(line[6:])["choices"]
                    if choice:
                        streamed.append(choice[0]["delta"].get("content") or "")
        assert "".join(streamed) == want


def test_policies_that_cannot_decode_full_attention_are_refused_at_start(llada_checkpoint):
    with pytest.raises(Exception, match="'full'"):
        with diffusion_llm(llada_checkpoint, diffusion_block_size=4,
                           additional_config={"diffusion_policy": "focus"}):
            pass
