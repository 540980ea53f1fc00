"""Sparse-dLLM's prefix side (``sparse_prefix``) in the engine: keeping the whole prefix
equals ``standard`` token for token (through the sparse attention path), a partial prefix
equals the plain PyTorch reference of the paper's loop on the SDAR reference, the kept
lists are freed with the block and the request, and bad options are refused."""

from __future__ import annotations

import gc
import weakref

import pytest
from conftest import diffusion_llm
from reference_sdar import ReferenceSDAR, reference_generate
from reference_sparse_prefix import reference_sparse_prefix_generate
from test_early_skip import run
from test_parity import checkpoint_info, make_prompts

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from vllm_diffusion_lab.fixtures.tiny_sdar import build_tiny_sdar

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def three_layer_checkpoint(tmp_path_factory):
    return build_tiny_sdar(tmp_path_factory.mktemp("sdar-3-layers"), num_layers=3, seed=5)


@pytest.mark.parametrize("block_size,per_kv_head", [(16, True)])
def test_keeping_the_whole_prefix_equals_standard(dense_checkpoint, sparse_calls, block_size,
                                                  per_kv_head):
    mask_id, stops, vocab_size = checkpoint_info(dense_checkpoint)
    prompts = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=70 + block_size)
    options = {"strategy": "low_confidence_dynamic", "threshold": 0.6}
    got, _ = run(dense_checkpoint, block_size, prompts, "sparse_prefix",
                 {**options, "retention_ratio": 1.0, "per_kv_head": per_kv_head},
                 3 * block_size)
    reference = ReferenceSDAR(dense_checkpoint)
    for prompt, tokens in zip(prompts, got):
        assert tokens == reference_generate(reference, prompt, block_size=block_size,
                                            mask_id=mask_id, max_tokens=3 * block_size,
                                            **options)
    assert any(sparse for sparse, _ in sparse_calls)  # the sparse kernel ran
    assert any(scoring for _, scoring in sparse_calls)


CASES = {
    "b8-r0.5-shared": (8, 0.5, 3, 1, False, "low_confidence_static"),
    "b8-r0.3-per-head-delay0": (8, 0.3, 3, 0, True, "threshold"),
    "b16-r0.3-shared-pool1": (16, 0.3, 1, 1, False, "low_confidence_static"),
    "b16-r0.1-per-head-delay2": (16, 0.1, 5, 2, True, "low_confidence_dynamic"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_partial_prefix_equals_the_reference(three_layer_checkpoint, sparse_calls, case):
    block_size, ratio, kernel, delay, per_kv_head, strategy = case
    checkpoint = three_layer_checkpoint
    mask_id, stops, vocab_size = checkpoint_info(checkpoint)
    prompts = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=90 + block_size)
    prompts.append(prompts[-1] * 3)  # a longer prefix
    # A high threshold: blocks take several steps, most of them after the selection.
    options = {"strategy": strategy, "threshold": 1.0, "retention_ratio": ratio,
               "pool_kernel": kernel, "delay_steps": delay, "per_kv_head": per_kv_head}
    got, _ = run(checkpoint, block_size, prompts, "sparse_prefix", options, 3 * block_size)
    reference = ReferenceSDAR(checkpoint)
    want = [reference_sparse_prefix_generate(reference, prompt, block_size=block_size,
                                             mask_id=mask_id, max_tokens=3 * block_size,
                                             **options) for prompt in prompts]
    assert got == want
    dense = [reference_generate(reference, prompt, block_size=block_size, mask_id=mask_id,
                                max_tokens=3 * block_size, strategy=strategy, threshold=1.0)
             for prompt in prompts]
    if ratio <= 0.1:
        assert got != dense  # the sparsity changed something: the test can tell them apart
    assert any(sparse for sparse, _ in sparse_calls)


def test_moe_model_equals_the_reference(moe_checkpoint):
    block_size = 8
    mask_id, stops, vocab_size = checkpoint_info(moe_checkpoint)
    prompts = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=123)
    options = {"strategy": "low_confidence_dynamic", "threshold": 0.5, "retention_ratio": 0.4,
               "pool_kernel": 3, "delay_steps": 1, "per_kv_head": False}
    got, _ = run(moe_checkpoint, block_size, prompts, "sparse_prefix", options, 2 * block_size)
    reference = ReferenceSDAR(moe_checkpoint)
    assert got == [reference_sparse_prefix_generate(
        reference, prompt, block_size=block_size, mask_id=mask_id, max_tokens=2 * block_size,
        **options) for prompt in prompts]


def test_kept_lists_are_freed_with_the_block_and_the_request(dense_checkpoint):
    block_size = 8
    mask_id, stops, vocab_size = checkpoint_info(dense_checkpoint)
    prompt = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=5)[-1]
    with diffusion_llm(dense_checkpoint, diffusion_block_size=block_size,
                       additional_config={"diffusion_policy": "sparse_prefix"}) as llm:
        runner = (llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
                  .worker.model_runner)
        engine = llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=4 * block_size, ignore_eos=True,
                                extra_args={"strategy": "sequential", "retention_ratio": 0.5})
        engine.add_request("kept", TokensPrompt(prompt_token_ids=prompt), params)
        kept_refs = []
        for _ in range(40):
            engine.step()
            for request in runner.diffusion_requests.values():
                state = request.policy_state
                if state.kept is not None:
                    kept_refs.append(weakref.ref(state.kept))
                    if request.canvas.steps == 0:
                        raise AssertionError("a new block still holds the last one's lists")
            if len(kept_refs) > 3:
                break
        assert kept_refs, "no step attended sparsely"
        del request, state
        engine.abort_request(["kept"])
        engine.step()
        assert not runner.diffusion_requests
        gc.collect()
        assert all(ref() is None for ref in kept_refs)


def test_bad_options_are_refused(dense_checkpoint):
    with diffusion_llm(dense_checkpoint, diffusion_block_size=4,
                       additional_config={"diffusion_policy": "sparse_prefix"}) as llm:
        for options, message in [({"pool_kernel": 4}, "'pool_kernel' must be odd"),
                                 ({"retention_ratio": 1.5}, "retention_ratio"),
                                 ({"delay_steps": -1}, "delay_steps"),
                                 ({"chunk_size": 2}, "chunk_size")]:
            params = SamplingParams(temperature=0, max_tokens=4, extra_args=options)
            with pytest.raises(Exception, match=message):
                llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], params,
                             use_tqdm=False)
