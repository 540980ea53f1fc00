"""Fast-dLLM's approximate caches on LLaDA through the engine (``diffusion_cache_mode``):
greedy output equal to the authors' ``generate_with_prefix_cache`` and
``generate_with_dual_cache`` (``reference_llada.reference_generate_cached``, importing no
package code) token for token on a named grid (block sizes 4 and 8, canvases of 8 to 24,
one and two tokens per step, prompts shorter and longer than a block, alone and batched);
one KV refresh per block, fewer rows than the exact loop; Fast-dLLM's threshold and
dynamic (``factor``) rules under each mode; preemption (the KV rebuilt by a refresh) and
abort; the refusals of what the modes do not serve. Dream's block loop:
``test_dream_cache.py``."""

from __future__ import annotations

import pytest
from conftest import (assert_batched_and_alone, assert_dual_cache_preemptions_refresh,
                      diffusion_llm)
from reference_llada import reference_generate_cached
from test_full_attention import (GRID, PROMPTS, greedy, llada_checkpoint,  # noqa: F401
                                 reference)

from vllm_diffusion_lab.offline import stats_delta

pytestmark = pytest.mark.engine


def expected_rows(prompt: int, gen_length: int, block: int, steps: int, cache: str) -> int:
    """Rows a request computes: per block, a refresh of the whole sequence, then ``steps -
    1`` steps of the block and the canvas after it (prefix) or the block alone (dual)."""
    end = prompt + gen_length
    return sum(end + (steps - 1) * (end - start if cache == "prefix" else block)
               for start in range(prompt, end, block))


@pytest.mark.parametrize("block", [4, 8])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_greedy_equals_fast_dllm(llada_checkpoint, reference, cache, block):
    """Every grid point of the block size: each prompt in one batch, then the longest
    alone; one refresh per block of each request, and exactly the rows Fast-dLLM's loop
    computes (every grid point has at least as many masks per block as steps, so no
    step is skipped)."""
    model, mask_id = reference
    cases = [(g, s) for b, g, s in GRID if b == block]
    with diffusion_llm(llada_checkpoint, diffusion_block_size=block, max_num_seqs=4,
                       additional_config={"diffusion_cache_mode": cache}) as llm:
        before = llm.collective_rpc("diffusion_stats")[0]
        for gen_length, steps in cases:
            params = greedy(gen_length, denoising_steps=steps)
            want = {name: reference_generate_cached(
                model, prompt, mask_id=mask_id, cache=cache, gen_length=gen_length,
                block_length=block, steps=steps * (gen_length // block))
                for name, prompt in PROMPTS.items()}
            assert_batched_and_alone(llm, PROMPTS, params, want, "long", gen_length)
        stats = stats_delta(before, llm.collective_rpc("diffusion_stats")[0])
    requests = [*PROMPTS.values(), PROMPTS["long"]]
    assert stats["kv_refreshes"] == sum(g // block for g, _ in cases) * len(requests), stats
    assert stats["positions_computed"] == sum(
        expected_rows(len(p), g, block, s, cache) for g, s in cases for p in requests), stats


# Fast-dLLM's parallel rules: (engine strategy options, reference keyword)
PARALLEL_RULES = {
    "threshold 0.9": ({"strategy": "threshold", "threshold": 0.9}, {"threshold": 0.9}),
    "threshold 0.3": ({"strategy": "threshold", "threshold": 0.3}, {"threshold": 0.3}),
    "factor 1": ({"strategy": "factor", "factor": 1.0}, {"factor": 1.0}),
    "factor 4": ({"strategy": "factor", "factor": 4.0}, {"factor": 4.0}),
}


@pytest.mark.parametrize("cache", ["recompute", "prefix", "dual"])
def test_threshold_and_factor_rules_equal_fast_dllm(llada_checkpoint, reference, cache):
    """Fast-dLLM's threshold and dynamic (``factor``) rules under each cache mode (blocks
    of 8, canvas 16: ``generate`` without a cache for ``recompute``), every prompt in one
    batch and the longest alone."""
    model, mask_id = reference
    with diffusion_llm(llada_checkpoint, diffusion_block_size=8, max_num_seqs=4,
                       additional_config={"diffusion_cache_mode": cache}) as llm:
        for name, (options, rule) in PARALLEL_RULES.items():
            params = greedy(16, **options)
            want = {prompt: reference_generate_cached(
                model, ids, mask_id=mask_id, cache="none" if cache == "recompute" else cache,
                gen_length=16, block_length=8, steps=16, **rule)
                for prompt, ids in PROMPTS.items()}
            assert_batched_and_alone(llm, PROMPTS, params, want, "long", name)


def test_preemption_rebuilds_the_kv_with_a_refresh(llada_checkpoint):
    """An engine short of pages preempts requests mid-block under ``dual``; each resumes
    with a refresh (more refreshes than blocks) and finishes with its whole output; an
    aborted request gives its pages back. Outputs may differ from an engine with room
    (the refresh sees the block's newer tokens), which is documented."""
    assert_dual_cache_preemptions_refresh(
        llada_checkpoint, [PROMPTS["long"], PROMPTS["block"], PROMPTS["short"],
                           [30, 31, 32, 33, 34]])


@pytest.mark.parametrize("mode, message", [
    ("exact", "must be one of recompute, prefix, dual"),
    ("dual", "is for full-attention models"),
])
def test_unserved_modes_are_refused_at_start(dense_checkpoint, llada_checkpoint, mode,
                                             message):
    checkpoint = llada_checkpoint if mode == "exact" else dense_checkpoint
    with pytest.raises(Exception, match=message):
        with diffusion_llm(checkpoint, diffusion_block_size=4,
                           additional_config={"diffusion_cache_mode": mode}):
            pass
