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

from conftest import diffusion_llm
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


def token_prompts(prompts):
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=p) for p in prompts]


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
