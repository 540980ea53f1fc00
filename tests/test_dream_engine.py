"""Dream through the engine: greedy output equal to the published ``diffusion_generate``
(``reference_dream``, importing no package code) token for token on a named grid -- the
whole canvas as one block, each position read from the row before it, the timestep
schedule with both served ``alg`` rankings, steps that transfer nothing -- for prompts
shorter and longer than 8 tokens, alone and in one batch mixing everything; and the
refusals of what the engine does not serve (a canvas larger than the block, the
``topk_margin`` and ``origin`` algs).

One engine serves every test (each start costs seconds): block size 16, and a limit of 3
steps without progress, below the runs of steps the schedule leaves empty by design."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from conftest import diffusion_llm, token_prompts
from reference_dream import ReferenceDream, reference_generate, transfer_count
from test_faults import REJECTED

from vllm_diffusion_lab.fixtures.tiny_dream import build_tiny_dream

pytestmark = pytest.mark.engine

BLOCK_SIZE = 16
PROMPTS = {"short": [11, 12, 13], "long": list(range(40, 51))}  # 3 and 11 tokens
# (canvas = max_tokens, steps; None: the engine's default, the block size): as many steps
# as masks and half as many, and twice as many (long runs of steps transferring nothing)
CASES = {"canvas8-steps8": (8, 8), "canvas8-steps4": (8, 4), "canvas8-default": (8, None),
         "canvas16-steps16": (16, 16), "canvas16-steps8": (16, 8)}
ALGS = ("maskgit_plus", "entropy")


@pytest.fixture(scope="module")
def dream_checkpoint(tmp_path_factory) -> pathlib.Path:
    return build_tiny_dream(tmp_path_factory.mktemp("dream-engine"))


@pytest.fixture(scope="module")
def reference(dream_checkpoint):
    mask_id = json.loads((dream_checkpoint / "config.json").read_text())["mask_token_id"]
    return ReferenceDream(dream_checkpoint), mask_id


@pytest.fixture(scope="module")
def llm(dream_checkpoint):
    with diffusion_llm(dream_checkpoint, diffusion_block_size=BLOCK_SIZE, max_num_seqs=8,
                       additional_config={"diffusion_max_steps_without_progress": 3}) as engine:
        yield engine


def steps_of(case: str) -> int:
    steps = CASES[case][1]
    return BLOCK_SIZE if steps is None else steps


def greedy(case: str, alg: str):
    from vllm import SamplingParams

    canvas, steps = CASES[case]
    extra = {"alg": alg} if steps is None else {"alg": alg, "denoising_steps": steps}
    return SamplingParams(temperature=0.0, max_tokens=canvas, ignore_eos=True,
                          extra_args=extra)


def published(reference, prompt: list[int], case: str, alg: str) -> list[int]:
    model, mask_id = reference
    return reference_generate(model, prompt, mask_id=mask_id, max_new_tokens=CASES[case][0],
                              steps=steps_of(case), alg=alg)


def test_the_grid_has_steps_that_transfer_nothing():
    """With at least as many steps as masks the first step truncates to 0 transfers; the
    default-steps case runs more consecutive empty steps than the engine's limit of steps
    without progress (3)."""
    for case, (canvas, _) in CASES.items():
        steps = steps_of(case)
        times = torch.linspace(1, 1e-3, steps + 1)
        counts, left = [], canvas
        for step in range(steps):
            counts.append(transfer_count(left, step, times))
            left -= counts[-1]
        assert left == 0 and (counts[0] == 0) == (steps >= canvas), (case, counts)
        if case == "canvas8-default":
            assert counts[:4] == [0, 0, 0, 0], counts


def test_greedy_equals_the_published_loop(llm, reference):
    """Each case, alg and prompt alone, then all of them in one batch (canvases, steps,
    algs and prompt lengths mixed)."""
    cases = [(case, alg, name) for case in CASES for alg in ALGS for name in PROMPTS]
    want = {key: published(reference, PROMPTS[key[2]], key[0], key[1]) for key in cases}
    for case, alg, name in cases:
        alone = llm.generate(token_prompts([PROMPTS[name]]), greedy(case, alg),
                             use_tqdm=False)[0].outputs[0]
        assert list(alone.token_ids) == want[case, alg, name], (case, alg, name)
    batch = llm.generate(token_prompts([PROMPTS[name] for _, _, name in cases]),
                         [greedy(case, alg) for case, alg, _ in cases], use_tqdm=False)
    for key, output in zip(cases, batch):
        assert list(output.outputs[0].token_ids) == want[key], key


def test_a_canvas_larger_than_the_block_is_refused(llm):
    from vllm import SamplingParams

    prompt = token_prompts([PROMPTS["short"]])
    with pytest.raises(REJECTED, match=r"max_tokens \(17\) is larger than the diffusion "
                                       r"block size \(16\): Dream decodes the whole canvas"):
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=17), use_tqdm=False)
    # unset: the model length minus the prompt, refused once vLLM resolved it
    with pytest.raises(REJECTED, match=r"max_tokens \(509\) is larger"):
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=None),
                     use_tqdm=False)


@pytest.mark.parametrize("alg", ["topk_margin", "origin"])
def test_unserved_algs_are_refused_by_name(llm, alg):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, extra_args={"alg": alg})
    with pytest.raises(REJECTED, match=rf"option 'alg' '{alg}' is not served"):
        llm.generate(token_prompts([PROMPTS["short"]]), params, use_tqdm=False)


def published_chat_answer(reference, checkpoint, messages) -> list[int]:
    """The published loop on the chat-templated prompt (the whole 16-token canvas, 16
    steps, ``maskgit_plus``: the family's defaults), cut after its first stop token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    stops = set(json.loads((checkpoint / "generation_config.json").read_text())["eos_token_id"])
    model, mask_id = reference
    answer = reference_generate(model, list(prompt), mask_id=mask_id,
                                max_new_tokens=BLOCK_SIZE, steps=BLOCK_SIZE,
                                alg="maskgit_plus")
    ends = [i for i, token in enumerate(answer) if token in stops]
    return answer[:ends[0] + 1] if ends else answer


def test_chat_through_the_llm_api_and_vllm_serve(dream_checkpoint, llm, reference, tmp_path):
    """Dream's chat template (ChatML, as Dream-v0-Instruct's) through the ``LLM`` API and
    ``vllm serve``: the answer is the published loop's on the templated prompt, up to its
    first stop token, streamed and not."""
    import requests
    from vllm import SamplingParams

    from vllm_diffusion_lab.fixtures.server import chat_contents, vllm_server

    messages = [{"role": "user", "content": "What is 12 plus 7?"}]
    chat = llm.chat(messages, SamplingParams(temperature=0, max_tokens=BLOCK_SIZE),
                    use_tqdm=False)[0].outputs[0]
    assert list(chat.token_ids) == published_chat_answer(reference, dream_checkpoint, messages)
    body = {"model": str(dream_checkpoint), "temperature": 0, "max_tokens": BLOCK_SIZE,
            "messages": messages}
    with vllm_server(dream_checkpoint, "--max-model-len", "512", "--max-num-seqs", "2",
                     "--enforce-eager", "--additional-config",
                     json.dumps({"diffusion_block_size": BLOCK_SIZE}),
                     log_path=tmp_path / "serve.log") as url:
        assert chat_contents(url, body) == (chat.text, chat.text)
        # an unset max_tokens resolves to the model length minus the prompt: refused
        # with the reason, and the server goes on
        unset = requests.post(f"{url}/v1/chat/completions",
                              json={k: v for k, v in body.items() if k != "max_tokens"},
                              timeout=120)
        assert unset.status_code == 400, unset.text
        assert "Dream decodes the whole canvas" in unset.json()["error"]["message"]


def test_tensor_parallel_equals_the_published_loop(dream_checkpoint, reference, two_cpu_ranks):
    """Two ranks on CPU (gloo): vLLM shards Dream's heads (4 query, 2 KV), QKV biases and
    MLP; the outputs equal the single-process published loop for both served algs."""
    cases = [("canvas16-steps8", alg, name) for alg in ALGS for name in PROMPTS]
    with diffusion_llm(dream_checkpoint, diffusion_block_size=BLOCK_SIZE, max_num_seqs=4,
                       max_model_len=64, tensor_parallel_size=2,
                       distributed_executor_backend="mp") as engine:
        outputs = engine.generate(token_prompts([PROMPTS[name] for *_, name in cases]),
                                  [greedy(case, alg) for case, alg, _ in cases],
                                  use_tqdm=False)
    for (case, alg, name), output in zip(cases, outputs):
        assert list(output.outputs[0].token_ids) == published(reference, PROMPTS[name],
                                                              case, alg), (alg, name)
