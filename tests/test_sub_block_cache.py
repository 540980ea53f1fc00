"""Fast-dLLM v2's block cache (option ``sub_block_cache``, the published
``use_block_cache``) through the engine: greedy output equal to the published ``generate``
with ``use_block_cache=True`` (``reference_fast_dllm_v2``, importing no package code)
token for token, and the rows computed equal to the rows its forwards take, on a named
grid (block 16, sub-blocks of 4 and 8, thresholds 0.9 and 0.3, prompts shorter than a
block, of one and two blocks and ending inside one, alone and in one batch); the plan of
each step (``SubBlockCache``); and the refusals."""

from __future__ import annotations

import pytest
import torch
from test_fast_dllm_v2 import (BLOCK_SIZE, PROMPTS, checkpoint, reference,  # noqa: F401
                               token_prompts)
from test_faults import REJECTED

from vllm_diffusion.policies.standard import StandardConfig
from vllm_diffusion.policies.parts.sub_block_cache import SubBlockCache
from vllm_diffusion.step.request import BlockCanvas

MASK = 99
MAX_TOKENS = 40
# (sub_block_size, threshold)
CASES = {"sub4-threshold0.9": (4, 0.9), "sub8-threshold0.9": (8, 0.9),
         "sub4-threshold0.3": (4, 0.3), "sub8-threshold0.3": (8, 0.3)}


def cached(case: str, max_tokens: int = MAX_TOKENS, use_cache: bool = True):
    from vllm import SamplingParams

    sub_block, threshold = CASES[case]
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args={"sub_block_size": sub_block, "threshold": threshold,
                                      "sub_block_cache": use_cache})


def published(model_and_mask, prompt: list[int], case: str,
              max_new_tokens: int | None = None, rows: list[int] | None = None,
              use_block_cache: bool = True) -> list[int]:
    from reference_fast_dllm_v2 import reference_generate

    model, mask_id = model_and_mask
    sub_block, threshold = CASES[case]
    return reference_generate(
        model, prompt, mask_id=mask_id,
        max_new_tokens=max_new_tokens or (MAX_TOKENS // BLOCK_SIZE + 2) * BLOCK_SIZE,
        block_size=BLOCK_SIZE, small_block_size=sub_block, threshold=threshold,
        use_block_cache=use_block_cache, rows=rows)


@pytest.fixture(scope="module")
def llm(checkpoint):  # noqa: F811
    from conftest import diffusion_llm

    with diffusion_llm(checkpoint, max_num_seqs=8) as engine:
        yield engine


@pytest.mark.engine
def test_greedy_equals_the_published_loop_with_its_block_cache(llm, reference):  # noqa: F811
    """Each case and prompt alone, then all of them in one batch; the cache changes some
    outputs (its stale KV), so the grid tells the two loops apart."""
    cases = [(case, name) for case in CASES for name in PROMPTS]
    want = {key: published(reference, PROMPTS[key[1]], key[0])[:MAX_TOKENS] for key in cases}
    exact = {key: published(reference, PROMPTS[key[1]], key[0],
                            use_block_cache=False)[:MAX_TOKENS] for key in cases}
    assert want != exact  # the grid sees the stale KV
    for case, name in cases:
        alone = llm.generate(token_prompts([PROMPTS[name]]), cached(case),
                             use_tqdm=False)[0].outputs[0]
        assert list(alone.token_ids) == want[case, name], (case, name)
    batch = llm.generate(token_prompts([PROMPTS[name] for _, name in cases]),
                         [cached(case) for case, _ in cases], use_tqdm=False)
    for key, output in zip(cases, batch):
        assert list(output.outputs[0].token_ids) == want[key], key


@pytest.mark.engine
def test_rows_computed_are_the_published_forwards_rows(llm, reference):  # noqa: F811
    """Outputs ending on a block end: the engine's rows are the reference's forwards'
    rows but the last commit (the engine finishes the request before committing its last
    block), with and without the cache, and the cache computes fewer (at threshold 0.3
    the tiny model commits each sub-block in one step, so only 0.9 saves rows)."""
    from vllm_diffusion_lab.offline import stats_delta

    rows_by_cache = {True: 0, False: 0}
    for case in ("sub4-threshold0.9", "sub8-threshold0.3"):
        for use_cache in (True, False):
            for name, prompt in PROMPTS.items():
                max_tokens = 2 * BLOCK_SIZE - len(prompt) % BLOCK_SIZE
                rows: list[int] = []
                want = published(reference, prompt, case, 2 * BLOCK_SIZE, rows, use_cache)
                params = cached(case, max_tokens, use_cache)
                before = llm.collective_rpc("diffusion_stats")[0]
                out = llm.generate(token_prompts([prompt]), params, use_tqdm=False)[0]
                stats = stats_delta(before, llm.collective_rpc("diffusion_stats")[0])
                assert list(out.outputs[0].token_ids) == want[:max_tokens], (case, name)
                assert stats["positions_computed"] == sum(rows) - BLOCK_SIZE, (case, name)
                rows_by_cache[use_cache] += sum(rows)
    assert rows_by_cache[True] < rows_by_cache[False]


def test_partial_steps_need_a_cached_block_and_a_known_sub_block_start():
    """The plan: whole block until a step computed it, and whenever the active sub-block
    starts masked; else the active sub-block alone."""
    cache = SubBlockCache(8)
    canvas = BlockCanvas(0, torch.tensor([5, MASK, MASK, MASK, MASK, MASK, MASK, MASK]))
    assert cache.plan(canvas, MASK, 4).compute is None  # nothing cached yet
    cache.after_step(torch.tensor([True] + [False] * 7))  # read position 0 only
    assert cache.plan(canvas, MASK, 4).compute is None  # still nothing of the block
    cache.after_step(torch.tensor([False] + [True] * 7))
    assert cache.plan(canvas, MASK, 4).compute.tolist() == [True] * 4 + [False] * 4
    cache.after_step(torch.tensor([False, True, True, True] + [False] * 4))
    canvas.tokens[1:4] = torch.tensor([6, 7, 8])  # sub-block 0 decoded; 1 starts masked
    assert cache.plan(canvas, MASK, 4).compute is None
    cache.after_step(torch.tensor([False] + [True] * 7))
    canvas.tokens[4] = 9
    assert cache.plan(canvas, MASK, 4).compute.tolist() == [False] * 4 + [True] * 4
    cache.start_block()  # a preemption freed the block's KV
    assert cache.plan(canvas, MASK, 4).compute is None


def test_the_option_is_refused_with_chunks_editing_and_whole_block_models():
    from vllm_diffusion.capabilities import ModelCapabilities, refusal
    from vllm_diffusion.options import OptionError
    from vllm_diffusion.policies.standard import StandardPolicy

    with pytest.raises(OptionError, match="'sub_block_cache' cannot be combined with "
                                          "'chunk_size' or 'chunk_reuse'"):
        StandardConfig(sub_block_cache=True, chunk_size=4).validate_for_block(16, "request")
    with pytest.raises(OptionError, match="'editing_threshold' cannot apply with "
                                          "'sub_block_cache'"):
        StandardConfig(sub_block_cache=True, editing_threshold=0.5).validate_for_block(
            16, "request")
    options = {"sub_block_cache": True}
    assert refusal(ModelCapabilities("Fast-dLLM v2", shifted_logits=True), StandardPolicy,
                   options) is None
    assert refusal(ModelCapabilities("SDAR"), StandardPolicy, options) is None
    for model in (ModelCapabilities("LLaDA", attention="full"),
                  ModelCapabilities("LLaDA2.2", routing_block_size=4)):
        assert "option 'sub_block_cache' computes only the active sub-block" in refusal(
            model, StandardPolicy, options), model.family


@pytest.mark.engine
def test_a_bad_request_is_refused_with_the_reason(llm):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, extra_args={
        "sub_block_cache": "yes"})
    with pytest.raises(REJECTED, match="sub_block_cache"):
        llm.generate(token_prompts([PROMPTS["short"]]), params, use_tqdm=False)


@pytest.mark.engine
def test_preempted_requests_finish_and_aborts_free_kv(checkpoint):  # noqa: F811
    """With pages for fewer requests than run, requests are preempted mid-block and
    resumed: the block's KV is recomputed whole at its next step (fresher than the
    published cache would keep it, so outputs may differ from the reference's), and
    every request finishes with its whole output; a request aborted mid-block gives its
    pages back."""
    from conftest import assert_abort_mid_block_frees_kv, diffusion_llm, watch_preemptions

    cases = [(case, name) for case in ("sub4-threshold0.9", "sub8-threshold0.9")
             for name in PROMPTS]
    with diffusion_llm(checkpoint, max_num_seqs=8, block_size=16, max_model_len=96,
                       num_gpu_blocks_override=10) as engine:
        preempted = watch_preemptions(engine)
        outputs = engine.generate(token_prompts([PROMPTS[name] for _, name in cases]),
                                  [cached(case) for case, _ in cases], use_tqdm=False)
        assert preempted, "no request was preempted; the test does not cover preemption"
        assert_abort_mid_block_frees_kv(engine, cached("sub4-threshold0.9").clone())
    assert [len(o.outputs[0].token_ids) for o in outputs] == [MAX_TOKENS] * len(cases)
