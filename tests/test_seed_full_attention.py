"""Sparse-dLLM (``sparse_prefix``), ES-dLLM (``es``) and Ada-DLM (``ada``) on LLaDA under
Fast-dLLM's dual cache: greedy output equal to the plain-PyTorch references
(``reference_seed_full_attention``, importing no package code) token for token on named
grids (blocks 4 and 8, canvases of 16 and 24, one token per step, two per step, a high and
a lower threshold, the methods' options varied), every prompt in one batch and the longest
alone; the work the engine counts equal to the references' (steps, rows, refreshes; ES
rows that reach the logits); preemption and abort under each; the refusals.

The lower threshold is 0.7, not lower: on the tiny checkpoints a threshold of 0.5 or less
commits most blocks whole at their refresh, where none of the methods acts yet."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from conftest import assert_dual_cache_preemptions_refresh, diffusion_llm
from reference_llada import ReferenceLLaDA, reference_generate_cached
from reference_seed_full_attention import (reference_ada_dual_generate,
                                           reference_es_dual_generate,
                                           reference_sparse_dual_generate)
from test_full_attention import (PROMPTS, greedy, llada_checkpoint,  # noqa: F401
                                 reference, token_prompts)

from vllm_diffusion_lab.fixtures.tiny_llada import build_tiny_llada
from vllm_diffusion_lab.offline import stats_delta

pytestmark = pytest.mark.engine

DUAL = {"diffusion_cache_mode": "dual"}
STATIC = {"strategy": "low_confidence_static"}  # one token per step unless denoising_steps


def threshold(value: float) -> dict:
    return {"strategy": "threshold", "threshold": value}


@pytest.fixture(scope="module")
def four_layer_llada(tmp_path_factory):
    """(checkpoint, reference, mask id) of a 4-layer LLaDA: two depths to skip after."""
    path = build_tiny_llada(tmp_path_factory.mktemp("llada-4-layers"), num_layers=4,
                            hidden_size=64, num_heads=4, num_kv_heads=2)
    mask_id = json.loads((path / "config.json").read_text())["mask_token_id"]
    return path, ReferenceLLaDA(path), mask_id


@contextlib.contextmanager
def one_thread():
    """The references' small products on one thread (on a loaded machine more threads
    mostly wait on each other); the engine's thread count is restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def assert_same(got: list[int], want: list[int], label) -> None:
    """Token for token, naming the first differing output position."""
    if got == want:
        return
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                 min(len(got), len(want)))
    raise AssertionError(f"{label}: first difference at output position {first} "
                         f"(engine {got[first:first + 1]}, reference {want[first:first + 1]})"
                         f"\nengine    {got}\nreference {want}")


def run_grid(checkpoint, model, mask_id, block, policy, cases, generate, engine=None,
             request=None) -> tuple[dict, list, dict]:
    """Each case (gen_length, options) of ``cases``: the prompts in one batch, then the
    longest alone, against ``generate`` (a reference, given the same options; run before
    the engine starts, whose threads would slow it). Returns the engine's stats over all
    of them, every request's reference trace (in order) and each case's reference
    outputs."""
    traces, outputs = [], {}
    with one_thread():
        for name, (gen_length, options) in cases.items():
            outputs[name], trace_of = {}, {}
            for prompt_name, prompt in PROMPTS.items():
                trace_of[prompt_name] = []
                outputs[name][prompt_name] = generate(
                    model, prompt, mask_id=mask_id, gen_length=gen_length,
                    block_length=block, trace=trace_of[prompt_name], **options)
            traces += [*trace_of.values(), trace_of["long"]]  # the longest again, alone
    with diffusion_llm(checkpoint, diffusion_block_size=block, max_num_seqs=4,
                       additional_config={"diffusion_policy": policy, **DUAL,
                                          **(engine or {})}) as llm:
        before = llm.collective_rpc("diffusion_stats")[0]
        for name, (gen_length, options) in cases.items():
            want = outputs[name]
            params = greedy(gen_length, **options, **(request or {}))
            batch = llm.generate(token_prompts(PROMPTS.values()), params, use_tqdm=False)
            for prompt_name, output in zip(PROMPTS, batch):
                assert_same(list(output.outputs[0].token_ids), want[prompt_name],
                            (name, prompt_name, "batched"))
            alone = llm.generate(token_prompts([PROMPTS["long"]]), params, use_tqdm=False)
            assert_same(list(alone[0].outputs[0].token_ids), want["long"],
                        (name, "long", "alone"))
        stats = stats_delta(before, llm.collective_rpc("diffusion_stats")[0])
    return stats, traces, outputs


def reference_outputs(model, mask_id, block, cases, generate, **override) -> dict:
    """Each case's reference outputs by prompt, ``override`` replacing options."""
    with one_thread():
        return {name: {prompt_name: generate(model, prompt, mask_id=mask_id,
                                             gen_length=gen_length, block_length=block,
                                             **{**options, **override})
                       for prompt_name, prompt in PROMPTS.items()}
                for name, (gen_length, options) in cases.items()}


def assert_work(stats: dict, traces: list, num_blocks: int) -> None:
    """The engine's counters equal the references': a refresh per block, the steps, and
    the rows the forwards took in (the whole sequence at a refresh, the block after)."""
    steps = [step for trace in traces for step in trace]
    assert stats["kv_refreshes"] == num_blocks, stats
    assert stats["denoising_steps"] == len(steps), stats
    assert stats["positions_computed"] == sum(rows for rows, _ in steps), stats


def blocks_of(cases: dict, block: int) -> int:
    """Blocks the grid's requests decode (each case: every prompt, and the longest again)."""
    return sum(g // block for g, _ in cases.values()) * (len(PROMPTS) + 1)


def dual_cache_cases(model, mask_id: int, steps_per_block: int | None = None):
    """(block, gen_length, prompt, the dual-cache reference's canvas) over the self-checks'
    grid: blocks 4 and 8, every prompt; one step per position, or ``steps_per_block``."""
    for block, gen_length in [(4, 16), (8, 24)]:
        steps = gen_length if steps_per_block is None else steps_per_block * gen_length // block
        for prompt in PROMPTS.values():
            yield block, gen_length, prompt, reference_generate_cached(
                model, prompt, mask_id=mask_id, cache="dual", gen_length=gen_length,
                block_length=block, steps=steps)


def test_the_sparse_reference_keeping_everything_is_the_dual_cache(reference):
    """Self-check of the reference: the whole context kept is Fast-dLLM's dual cache."""
    model, mask_id = reference
    with one_thread():
        for block, gen_length, prompt, dual in dual_cache_cases(model, mask_id):
            assert reference_sparse_dual_generate(
                model, prompt, mask_id=mask_id, gen_length=gen_length,
                block_length=block, retention_ratio=1.0, pool_kernel=3,
                per_kv_head=True) == dual


def test_the_es_reference_without_skipping_is_the_dual_cache(four_layer_llada):
    """Self-check: nothing skipped is Fast-dLLM's dual cache."""
    _, model, mask_id = four_layer_llada
    with one_thread():
        for block, gen_length, prompt, dual in dual_cache_cases(model, mask_id):
            assert reference_es_dual_generate(
                model, prompt, mask_id=mask_id, gen_length=gen_length,
                block_length=block, skip_layers=(1, 2), skip_ratio=0.0) == dual


def test_the_ada_reference_freezing_everything_is_one_step_per_block(reference):
    """Self-check: a static threshold of 0 freezes every mask at the refresh, as the dual
    cache with one step per block."""
    model, mask_id = reference
    with one_thread():
        for block, gen_length, prompt, one_step in dual_cache_cases(model, mask_id,
                                                                    steps_per_block=1):
            assert reference_ada_dual_generate(
                model, prompt, mask_id=mask_id, gen_length=gen_length,
                block_length=block, static_threshold=0.0) == one_step


# block -> case -> (gen_length, options): the options go to the engine as the request's
# extra_args and to the reference as its keyword arguments
SPARSE_GRID = {
    4: {"g16-one-per-step-r0.5-k3": (16, {**STATIC, "retention_ratio": 0.5,
                                          "pool_kernel": 3}),
        "g24-threshold0.9-r0.25-k1-per-head": (24, {**threshold(0.9), "retention_ratio": 0.25,
                                                    "pool_kernel": 1, "per_kv_head": True}),
        "g16-threshold0.7-r0.25-k3-per-head": (16, {**threshold(0.7), "retention_ratio": 0.25,
                                                    "pool_kernel": 3, "per_kv_head": True})},
    8: {"g24-one-per-step-r0.25-k3-per-head": (24, {**STATIC, "retention_ratio": 0.25,
                                                    "pool_kernel": 3, "per_kv_head": True}),
        "g16-threshold0.9-r0.5-k1": (16, {**threshold(0.9), "retention_ratio": 0.5,
                                          "pool_kernel": 1}),
        "g24-threshold0.7-r0.5-k3-delay2": (24, {**threshold(0.7), "retention_ratio": 0.5,
                                                 "pool_kernel": 3, "delay_steps": 2}),
        "g16-two-per-step-r0.25-k1": (16, {**STATIC, "denoising_steps": 4,
                                           "retention_ratio": 0.25, "pool_kernel": 1})},
}


@pytest.mark.parametrize("block", SPARSE_GRID)
def test_sparse_prefix_equals_the_reference(llada_checkpoint, reference, block):
    """The kept context (prefix and suffix) chosen at the block's second step, attended
    alone with the block after it; the selection changes the output somewhere (the grid
    tells it from dense attention); exactly the dual cache's work."""
    model, mask_id = reference
    cases = SPARSE_GRID[block]
    dense = reference_outputs(model, mask_id, block, cases, reference_sparse_dual_generate,
                              retention_ratio=1.0, pool_kernel=1)
    stats, traces, outputs = run_grid(llada_checkpoint, model, mask_id, block,
                                      "sparse_prefix", cases, reference_sparse_dual_generate)
    assert_work(stats, traces, blocks_of(cases, block))
    assert outputs != dense, "no grid point differs from dense attention"


# block -> (engine skip_layers, cases); 4 layers: the default skips after layer 2
ES_GRID = {
    4: (None, {
        "g16-one-per-step-defaults": (16, STATIC),
        "g24-threshold0.9-defaults": (24, threshold(0.9)),
        "g16-threshold0.7-equations-only": (16, {**threshold(0.7), "alpha": 0.3,
                                                 "skip_ratio": 0.6, "refresh_period": None,
                                                 "keep_floor": False,
                                                 "priority_bonuses": False})}),
    8: ([1, 2], {
        "g24-one-per-step-defaults": (24, STATIC),
        "g16-threshold0.9-refresh3": (16, {**threshold(0.9), "refresh_period": 3}),
        "g24-threshold0.7-floor-without-bonuses": (24, {**threshold(0.7),
                                                        "refresh_period": None,
                                                        "priority_bonuses": False}),
        "g16-two-per-step-alpha0.8": (16, {**STATIC, "denoising_steps": 4, "alpha": 0.8})}),
}


@pytest.mark.parametrize("block", ES_GRID)
def test_es_equals_the_reference(four_layer_llada, block):
    """Block rows dropped after the skip layers at the steps between refreshes; the rows
    that reach the logits equal the reference's, fewer than the dual cache's; the
    skipping changes the output somewhere."""
    checkpoint, model, mask_id = four_layer_llada
    skip_layers, cases = ES_GRID[block]
    layers = tuple(skip_layers or (2,))

    def generate(*args, **kwargs):
        return reference_es_dual_generate(*args, skip_layers=layers, **kwargs)

    unskipped = reference_outputs(model, mask_id, block, cases, generate, skip_ratio=0.0)
    stats, traces, outputs = run_grid(
        checkpoint, model, mask_id, block, "es", cases, generate,
        engine={"skip_layers": skip_layers} if skip_layers else None)
    assert_work(stats, traces, blocks_of(cases, block))
    steps = [step for trace in traces for step in trace]
    assert stats["block_positions_after_eviction"] == sum(n for _, n in steps), stats
    assert stats["block_positions_after_eviction"] < block * len(steps), stats
    per_layer = stats["block_positions_per_layer"]
    assert per_layer[layers[0]] == per_layer[0] > per_layer[-1], stats
    assert outputs != unskipped, "no grid point differs from the dual cache without skipping"


ADA_GRID = {
    4: {"g16-paper": (16, {}),
        "g24-static0.9": (24, {"static_threshold": 0.9})},
    8: {"g24-paper": (24, {}),
        "g16-static0.9": (16, {"static_threshold": 0.9}),
        "g24-capacity0.5-history1-floor0.4": (24, {"capacity": 0.5, "history": 1,
                                                   "confidence_floor": 0.4})},
}


@pytest.mark.parametrize("block", ADA_GRID)
def test_ada_equals_the_reference(llada_checkpoint, reference, block):
    """The freeze rule over the block's masks, every block row computed every step."""
    model, mask_id = reference
    cases = ADA_GRID[block]
    stats, traces, _ = run_grid(llada_checkpoint, model, mask_id, block, "ada", cases,
                                reference_ada_dual_generate,
                                request={"intra_block_cache": False})
    assert_work(stats, traces, blocks_of(cases, block))


# policy -> (engine options, request options, the abort's request options)
UNDER_PREEMPTION = {
    "sparse_prefix": ({}, {"retention_ratio": 0.5}, {"strategy": "sequential"}),
    "es": ({"skip_layers": [0]}, {"threshold": 0.9}, {"strategy": "sequential"}),
    "ada": ({}, {"intra_block_cache": False}, {"intra_block_cache": False}),
}


@pytest.mark.parametrize("policy", UNDER_PREEMPTION)
def test_preemption_and_abort_under_each_policy(llada_checkpoint, reference, policy):
    """An engine short of pages preempts requests mid-block; each resumes with a refresh
    and finishes with its whole output, no mask left; an aborted request gives its pages
    back."""
    _, mask_id = reference
    engine, options, abort_options = UNDER_PREEMPTION[policy]
    assert_dual_cache_preemptions_refresh(
        llada_checkpoint, [PROMPTS["long"], PROMPTS["block"], PROMPTS["short"],
                           [30, 31, 32, 33, 34]],
        engine={"diffusion_policy": policy, **engine}, options=options,
        abort_options=abort_options, mask_id=mask_id)


@pytest.mark.parametrize("policy, engine", [("sparse_prefix", {}),
                                            ("es", {"skip_layers": [0]})])
def test_policies_acting_on_the_cached_context_need_the_dual_cache(llada_checkpoint, policy,
                                                                   engine):
    with pytest.raises(Exception, match="diffusion_cache_mode"):
        with diffusion_llm(llada_checkpoint, diffusion_block_size=4,
                           additional_config={"diffusion_policy": policy, **engine,
                                              "diffusion_cache_mode": "recompute"}):
            pass


def test_ada_is_served_when_every_step_recomputes(llada_checkpoint, reference):
    """Under ``recompute`` (every step forwards the whole sequence) Ada-DLM decides as in
    LLaDA's published loop; its intra-block cache (part of a block per forward) is
    refused on full attention."""
    model, mask_id = reference
    with one_thread():
        want = [reference_ada_dual_generate(model, prompt, mask_id=mask_id, gen_length=16,
                                            block_length=4, cache="recompute")
                for prompt in PROMPTS.values()]
    with diffusion_llm(llada_checkpoint, diffusion_block_size=4, max_num_seqs=4,
                       additional_config={"diffusion_policy": "ada",
                                          "diffusion_cache_mode": "recompute"}) as llm:
        outputs = llm.generate(token_prompts(PROMPTS.values()),
                               greedy(16, intra_block_cache=False), use_tqdm=False)
        with pytest.raises(Exception, match="intra_block_cache"):
            llm.generate(token_prompts([PROMPTS["short"]]), greedy(4, intra_block_cache=True),
                         use_tqdm=False)
    for prompt_name, output, tokens in zip(PROMPTS, outputs, want):
        assert_same(list(output.outputs[0].token_ids), tokens, (prompt_name, "recompute"))


def test_focus_is_still_refused_on_full_attention(llada_checkpoint):
    with pytest.raises(Exception, match="'full'"):
        with diffusion_llm(llada_checkpoint, diffusion_block_size=4,
                           additional_config={"diffusion_policy": "focus", **DUAL}):
            pass
