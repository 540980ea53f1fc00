"""FOCUS in the engine: without eviction it decodes exactly like the standard policy; with
eviction it computes fewer positions in the later layers, and requests that evict do not
disturb requests beside them that do not."""

from __future__ import annotations

import pytest
from conftest import diffusion_llm, watch_preemptions
from reference_sdar import ReferenceSDAR, reference_generate
from test_parity import checkpoint_info, make_prompts

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

pytestmark = pytest.mark.engine

NO_EVICTION = {"evict": False, "intra_block_cache": False}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_focus_without_eviction_equals_the_reference(moe, dense_checkpoint, moe_checkpoint):
    checkpoint = moe_checkpoint if moe else dense_checkpoint
    block_size = 8
    mask_id, stops, vocab_size = checkpoint_info(checkpoint)
    reference = ReferenceSDAR(checkpoint)
    prompts = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=21)
    with diffusion_llm(checkpoint, diffusion_block_size=block_size,
                       additional_config={"diffusion_policy": "focus"}) as llm:
        for strategy in ("threshold", "low_confidence_dynamic"):
            options = {"strategy": strategy, "threshold": 0.7}
            params = SamplingParams(temperature=0, max_tokens=3 * block_size,
                                    extra_args={**options, **NO_EVICTION})
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                   use_tqdm=False)
            for prompt, out in zip(prompts, outputs):
                want = reference_generate(reference, prompt, block_size=block_size,
                                          mask_id=mask_id, max_tokens=3 * block_size,
                                          stop_token_ids=stops, **options)
                assert list(out.outputs[0].token_ids) == want, strategy


def test_eviction_reduces_later_layer_work_next_to_exact_requests(dense_checkpoint):
    block_size = 16
    mask_id, stops, vocab_size = checkpoint_info(dense_checkpoint)
    reference = ReferenceSDAR(dense_checkpoint)
    prompts = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=22)
    prompts += make_prompts(block_size, vocab_size, stops | {mask_id}, seed=23)
    options = {"strategy": "threshold", "threshold": 0.7}
    evicting = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, extra_args=options)
    exact = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                           extra_args={**options, **NO_EVICTION})
    params = [evicting, exact] * 3  # one batch, alternating
    with diffusion_llm(dense_checkpoint, diffusion_block_size=block_size,
                       additional_config={"diffusion_policy": "focus"}) as llm:
        before = llm.collective_rpc("diffusion_stats")[0]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               use_tqdm=False)
        after = llm.collective_rpc("diffusion_stats")[0]
    for prompt, out, p in zip(prompts, outputs, params):
        tokens = list(out.outputs[0].token_ids)
        assert len(tokens) == 40 and mask_id not in tokens
        if p is exact:
            assert tokens == reference_generate(reference, prompt, block_size=block_size,
                                                mask_id=mask_id, max_tokens=40, **options)
    computed = after["block_positions_computed"] - before["block_positions_computed"]
    after_eviction = (after["block_positions_after_eviction"]
                      - before["block_positions_after_eviction"])
    assert after_eviction < 0.9 * computed


def test_focus_options_are_validated(dense_checkpoint):
    from vllm.exceptions import VLLMValidationError

    with diffusion_llm(dense_checkpoint, diffusion_block_size=8,
                       additional_config={"diffusion_policy": "focus", "alpha": 2.0}) as llm:
        for extra, message in (({"alpha": 0.5}, r"'alpha' must be float in \(1.0, 64.0\]"),
                               ({"pool_kernel": 4}, r"'pool_kernel' must be odd"),
                               ({"commit": "lazy"}, r"'commit' must be one of 'exact'"),
                               ({"commit": "delayed"}, r"'commit' is engine-wide")):
            with pytest.raises((ValueError, VLLMValidationError), match=message):
                llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]),
                             SamplingParams(max_tokens=4, extra_args=extra), use_tqdm=False)


def test_delayed_commit_recomputes_only_unfrozen_positions(dense_checkpoint):
    block_size = 16
    mask_id, stops, vocab_size = checkpoint_info(dense_checkpoint)
    prompts = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=24)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True,
                            extra_args={"strategy": "threshold", "threshold": 0.7})
    with pytest.raises(Exception, match="commit='delayed' leaves committed KV approximate"):
        with diffusion_llm(dense_checkpoint, diffusion_block_size=block_size,
                           additional_config={"diffusion_policy": "focus", "commit": "delayed"}):
            pass
    computed = {}
    for commit in ("exact", "delayed"):
        with diffusion_llm(dense_checkpoint, diffusion_block_size=block_size,
                           enable_prefix_caching=False,
                           additional_config={"diffusion_policy": "focus", "commit": commit}) as llm:
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                   use_tqdm=False)
            stats = llm.collective_rpc("diffusion_stats")[0]
        assert all(len(o.outputs[0].token_ids) == 48 for o in outputs)
        computed[commit] = stats["positions_computed"] - stats["block_positions_computed"]
    # Prefill/commit rows: the delayed commit skips frozen positions of completed blocks.
    assert computed["delayed"] < computed["exact"]


@pytest.mark.parametrize("block_size", [8, 16])
def test_focus_with_eviction_equals_the_plain_torch_focus_reference(block_size, dense_checkpoint):
    from reference_focus import reference_focus_generate

    from vllm_diffusion.policies.focus import FocusConfig

    mask_id, stops, vocab_size = checkpoint_info(dense_checkpoint)
    reference = ReferenceSDAR(dense_checkpoint)
    prompts = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=30 + block_size)
    options = {"strategy": "threshold", "threshold": 0.7, "alpha": 1.5}
    with diffusion_llm(dense_checkpoint, diffusion_block_size=block_size,
                       additional_config={"diffusion_policy": "focus"}) as llm:
        before = llm.collective_rpc("diffusion_stats")[0]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                               SamplingParams(temperature=0, max_tokens=3 * block_size,
                                              ignore_eos=True, extra_args=options),
                               use_tqdm=False)
        after = llm.collective_rpc("diffusion_stats")[0]
    assert (after["block_positions_after_eviction"] - before["block_positions_after_eviction"]
            < after["block_positions_computed"] - before["block_positions_computed"])
    config = FocusConfig(strategy="threshold", threshold=0.7, alpha=1.5)
    for prompt, out in zip(prompts, outputs):
        want = reference_focus_generate(reference, prompt, block_size=block_size, mask_id=mask_id,
                                        max_tokens=3 * block_size, config=config)
        assert list(out.outputs[0].token_ids) == want


def test_focus_under_preemption_equals_the_focus_reference(dense_checkpoint):
    """Preempted requests lose their block's KV; FOCUS restarts the block's cache on resume."""
    import random

    from reference_focus import reference_focus_generate

    from vllm_diffusion.policies.focus import FocusConfig

    block_size, page_size = 8, 16
    mask_id, stops, vocab_size = checkpoint_info(dense_checkpoint)
    rng = random.Random(9)
    allowed = [t for t in range(vocab_size) if t not in stops | {mask_id}]
    prompts = [[rng.choice(allowed) for _ in range(rng.randint(5, 30))] for _ in range(8)]
    options = {"strategy": "threshold", "threshold": 0.7}
    with diffusion_llm(dense_checkpoint, diffusion_block_size=block_size, block_size=page_size,
                       num_gpu_blocks_override=12, enable_prefix_caching=False,
                       max_model_len=128,
                       additional_config={"diffusion_policy": "focus"}) as llm:
        preempted = watch_preemptions(llm)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                               SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                              extra_args=options), use_tqdm=False)
    assert preempted, "no request was preempted; the test does not cover preemption"
    reference = ReferenceSDAR(dense_checkpoint)
    config = FocusConfig(**options)
    for prompt, out in zip(prompts, outputs):
        assert list(out.outputs[0].token_ids) == reference_focus_generate(
            reference, prompt, block_size=block_size, mask_id=mask_id, max_tokens=40,
            config=config)
