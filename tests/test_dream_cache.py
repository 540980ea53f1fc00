"""Fast-dLLM's Dream block loop (``diffusion_cache_mode`` ``prefix`` / ``dual`` on Dream):
greedy output equal to a reference of the authors' ``generation_utils_block.py``
(``reference_dream.reference_generate_cached``, importing no package code) token for token
on a named grid -- blocks of 4 and 8 over a canvas of 16, the block's first position
decided alone by the refresh, the rest read from the window's own rows, the timestep
schedule ranked by negative entropy (the loop's ranking, the engine's default ``alg``
there) with as many steps per block as positions and half as many, and the threshold rule
-- for prompts shorter and longer than a block, alone and in one batch; one refresh per
block, fewer rows than the whole-canvas loop; a canvas larger than the block is served
block by block."""

from __future__ import annotations

import json
import pathlib

import pytest

from conftest import (assert_batched_and_alone, assert_dual_cache_preemptions_refresh,
                      diffusion_llm)
from reference_dream import ReferenceDream, reference_generate_cached

from vllm_diffusion_lab.fixtures.tiny_dream import build_tiny_dream
from vllm_diffusion_lab.offline import stats_delta

pytestmark = pytest.mark.engine

CANVAS = 16
PROMPTS = {"short": [11, 12, 13], "long": list(range(40, 51))}  # 3 and 11 tokens
# name: (engine request options, reference keywords, steps per block as a share of it)
RULES = {
    "schedule, steps = block": ({}, {}, 1),
    "schedule, half the steps": ({}, {}, 2),
    "threshold 0.9": ({"strategy": "threshold", "threshold": 0.9}, {"threshold": 0.9}, 1),
    "threshold 0.2": ({"strategy": "threshold", "threshold": 0.2}, {"threshold": 0.2}, 1),
}


@pytest.fixture(scope="module")
def dream_checkpoint(tmp_path_factory) -> pathlib.Path:
    return build_tiny_dream(tmp_path_factory.mktemp("dream-cache"))


@pytest.fixture(scope="module")
def reference(dream_checkpoint):
    mask_id = json.loads((dream_checkpoint / "config.json").read_text())["mask_token_id"]
    return ReferenceDream(dream_checkpoint), mask_id


@pytest.mark.parametrize("block", [4, 8])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_greedy_equals_fast_dllm_dream_block_loop(dream_checkpoint, reference, cache, block):
    from vllm import SamplingParams

    model, mask_id = reference
    with diffusion_llm(dream_checkpoint, diffusion_block_size=block, max_num_seqs=4,
                       additional_config={"diffusion_cache_mode": cache,
                                          "diffusion_canvas_tokens": CANVAS}) as llm:
        before = llm.collective_rpc("diffusion_stats")[0]
        for name, (options, rule, share) in RULES.items():
            steps = block // share
            params = SamplingParams(temperature=0.0, max_tokens=CANVAS, ignore_eos=True,
                                    extra_args={**options, "denoising_steps": steps})
            want = {prompt: reference_generate_cached(
                model, ids, mask_id=mask_id, cache=cache, max_new_tokens=CANVAS,
                block_length=block, steps=steps * (CANVAS // block), **rule)
                for prompt, ids in PROMPTS.items()}
            assert_batched_and_alone(llm, PROMPTS, params, want, "long", name)
        stats = stats_delta(before, llm.collective_rpc("diffusion_stats")[0])
    runs = len(RULES) * (len(PROMPTS) + 1)
    assert stats["kv_refreshes"] == runs * (CANVAS // block), stats


def test_preemption_resumes_the_block_loop_with_a_refresh(dream_checkpoint):
    """An engine short of pages preempts requests mid-block under ``dual``; each resumes
    with a refresh of its block (its first position already decided: the refresh reads the
    rest of the block) and finishes with its whole output; an aborted request gives its
    pages back."""
    assert_dual_cache_preemptions_refresh(
        dream_checkpoint, [PROMPTS["long"], PROMPTS["short"], [30, 31, 32, 33, 34], [7, 8]])
