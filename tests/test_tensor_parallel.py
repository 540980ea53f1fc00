"""Tensor parallelism (2 ranks on CPU, gloo): vLLM shards the Qwen3 layers; FOCUS sums the
importance of each rank's heads across ranks, so both ranks evict the same positions, and
sparse_prefix sums its prefix scores likewise. Outputs equal the single-process
references."""

from __future__ import annotations

import os

import pytest
from reference_focus import reference_focus_generate
from reference_sdar import ReferenceSDAR, reference_generate
from test_parity import checkpoint_info, make_prompts

from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_diffusion.policies.focus import FocusConfig
from vllm_diffusion_lab.offline import diffusion_llm

pytestmark = pytest.mark.engine


def test_tensor_parallel_standard_and_focus_equal_references(dense_checkpoint, two_cpu_ranks):
    block_size = 8
    mask_id, stops, vocab_size = checkpoint_info(dense_checkpoint)
    prompts = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=40)
    options = {"strategy": "threshold", "threshold": 0.7}
    no_eviction = {**options, "evict": False, "intra_block_cache": False}
    with diffusion_llm(dense_checkpoint, diffusion_block_size=block_size, max_model_len=256,
                       max_num_seqs=4, tensor_parallel_size=2,
                       distributed_executor_backend="mp",
                       additional_config={"diffusion_policy": "focus"}) as llm:
        outputs = {
            name: llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                               SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                              extra_args=extra), use_tqdm=False)
            for name, extra in (("standard", no_eviction), ("focus", options))}
    reference = ReferenceSDAR(dense_checkpoint)
    config = FocusConfig(**options)
    for prompt, standard, focus in zip(prompts, outputs["standard"], outputs["focus"]):
        assert list(standard.outputs[0].token_ids) == reference_generate(
            reference, prompt, block_size=block_size, mask_id=mask_id, max_tokens=24, **options)
        assert list(focus.outputs[0].token_ids) == reference_focus_generate(
            reference, prompt, block_size=block_size, mask_id=mask_id, max_tokens=24,
            config=config)


def test_tensor_parallel_sparse_prefix_equals_reference(dense_checkpoint, two_cpu_ranks):
    """A shared kept list sums the scores of both ranks' heads, so both ranks keep what
    one process keeps (per-KV-head lists need no exchange: each rank scores its own)."""
    from reference_sparse_prefix import reference_sparse_prefix_generate

    block_size = 8
    mask_id, stops, vocab_size = checkpoint_info(dense_checkpoint)
    prompts = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=44)
    options = {"strategy": "low_confidence_static", "threshold": 0.9, "retention_ratio": 0.3,
               "pool_kernel": 3, "delay_steps": 1, "per_kv_head": False}
    with diffusion_llm(dense_checkpoint, diffusion_block_size=block_size, max_model_len=256,
                       max_num_seqs=4, tensor_parallel_size=2,
                       distributed_executor_backend="mp",
                       additional_config={"diffusion_policy": "sparse_prefix"}) as llm:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                               SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                              extra_args=options), use_tqdm=False)
    reference = ReferenceSDAR(dense_checkpoint)
    for prompt, output in zip(prompts, outputs):
        assert list(output.outputs[0].token_ids) == reference_sparse_prefix_generate(
            reference, prompt, block_size=block_size, mask_id=mask_id, max_tokens=24,
            **options)


def test_tensor_parallel_llada2_equals_reference(tmp_path, two_cpu_ranks):
    """LLaDA2: vLLM shards the fused QKV, the dense layer and the experts; the router is
    replicated. Output equals the single-process reference."""
    from reference_llada2 import ReferenceLLaDA2
    from test_llada2 import token_info

    from vllm_diffusion_lab.fixtures.tiny_llada2 import build_tiny_llada2

    checkpoint = build_tiny_llada2(tmp_path / "llada2")
    mask_id, stops, vocab_size = token_info(checkpoint)
    prompts = make_prompts(8, vocab_size, stops | {mask_id}, seed=46)
    options = {"strategy": "low_confidence_dynamic", "threshold": 0.7}
    with diffusion_llm(checkpoint, diffusion_block_size=8, max_model_len=256, max_num_seqs=4,
                       tensor_parallel_size=2, distributed_executor_backend="mp") as llm:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                               SamplingParams(temperature=0, max_tokens=19, ignore_eos=True,
                                              extra_args=options), use_tqdm=False)
    reference = ReferenceLLaDA2(checkpoint)
    for prompt, output in zip(prompts, outputs):
        assert list(output.outputs[0].token_ids) == reference_generate(
            reference, prompt, block_size=8, mask_id=mask_id, max_tokens=19, **options)


def test_tensor_parallel_llada22_equals_reference(tmp_path, two_cpu_ranks):
    """LLaDA2.2: block routing on replicated router logits picks the same pools on both
    ranks; the joint editing loop's output equals the single-process reference wherever
    its anti-loop does not fire."""
    from test_llada22 import count_exact, joint_prompts, model_info

    from vllm_diffusion_lab.fixtures.tiny_llada2 import build_tiny_llada2

    checkpoint = build_tiny_llada2(tmp_path / "llada22", expert_capacity=4,
                                   routing_block_size=8, edit_logit_scale=1.5)
    prompts = joint_prompts(model_info(checkpoint)[0], seed=8)
    options = {"editing_threshold": 0.5, "max_post_steps": 4}
    with diffusion_llm(checkpoint, diffusion_block_size=8, max_model_len=256, max_num_seqs=4,
                       tensor_parallel_size=2, distributed_executor_backend="mp") as llm:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                               SamplingParams(temperature=0, max_tokens=19, ignore_eos=True,
                                              extra_args=options), use_tqdm=False)
    assert count_exact(checkpoint, prompts, outputs, options) >= 2
