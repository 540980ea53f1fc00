"""The liveness property test of ``test_liveness.py`` under every other policy, one engine
per policy (a module of its own: engines are opened one at a time in a process)."""

from __future__ import annotations

import pytest
from conftest import diffusion_llm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_liveness import (BLOCK_SIZE, EXAMPLES, PROMPT, SURFACE, generate_and_check,
                           reference_params)

from vllm_diffusion_lab.fixtures.tiny_sdar import build_tiny_sdar

pytestmark = pytest.mark.engine

STRATEGY = {"strategy": st.sampled_from(["low_confidence_dynamic", "threshold", "sequential",
                                         "entropy_bounded", "low_confidence_static",
                                         "timestep_schedule", "factor"]),
            "threshold": st.sampled_from([0.0, 0.9, 1.0]),
            "factor": st.sampled_from([0.1, 1.0, 4.0]),
            "alg": st.sampled_from(["maskgit_plus", "entropy"]),
            "eps": st.sampled_from([1e-3, 0.5]),
            "denoising_steps": st.integers(1, BLOCK_SIZE),
            "editing_threshold": st.sampled_from([None, 0.0, 0.9]),
            "entropy_bounded_order": st.sampled_from(["entropy", "confidence"]),
            "sub_block_size": st.sampled_from([None, 1, 2, BLOCK_SIZE])}
POLICY_OPTIONS = {
    "standard": st.fixed_dictionaries({}, optional={
        **STRATEGY, "chunk_size": st.sampled_from([1, 2, 4]), "chunk_reuse": st.booleans(),
        "sub_block_cache": st.booleans()}),
    "es": st.fixed_dictionaries({}, optional={
        **STRATEGY, "alpha": st.sampled_from([0.0, 1.0]),
        "skip_ratio": st.sampled_from([0.0, 0.9]), "refresh_period": st.sampled_from([1, 8]),
        "keep_floor": st.booleans()}),
    "elastic": st.fixed_dictionaries({}, optional={
        **STRATEGY, "warmup_steps": st.sampled_from([0, 3]), "explore_every": st.integers(2, 4),
        "chunk_reuse": st.booleans()}),
    "ada": st.fixed_dictionaries({}, optional={
        **STRATEGY, "capacity": st.sampled_from([1e-6, 0.5, 1.0]), "history": st.integers(1, 4),
        "confidence_floor": st.sampled_from([0.0, 1.0])}),
    "sparse_prefix": st.fixed_dictionaries({}, optional={
        **STRATEGY, "retention_ratio": st.sampled_from([0.0, 1.0]),
        "delay_steps": st.sampled_from([0, 3])}),
}


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """A 4-layer model, so that every policy's hook layers exist (ES skips after 2..L-2)."""
    return build_tiny_sdar(tmp_path_factory.mktemp("sdar-4-layers"), num_layers=4, seed=3)


def check_generated_requests(llm, reference, policy: str) -> None:
    """The property over generated sampling fields and ``policy``'s generated options:
    each request is refused, or finishes within the step bound, the reference request
    beside it unchanged (``test_liveness.generate_and_check``)."""

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(fields=SURFACE, extra_args=POLICY_OPTIONS[policy])
    def run(fields, extra_args):
        generate_and_check(llm, reference, fields, extra_args)

    run()


@pytest.mark.parametrize("policy", sorted(POLICY_OPTIONS))
def test_generated_requests_under_every_policy(four_layers, policy):
    with diffusion_llm(four_layers, diffusion_block_size=BLOCK_SIZE, max_model_len=128,
                       additional_config={"diffusion_policy": policy}) as llm:
        reference = (None if policy == "elastic" else list(
            llm.generate(PROMPT, reference_params(), use_tqdm=False)[0].outputs[0].token_ids))
        check_generated_requests(llm, reference, policy)


@pytest.fixture(scope="module")
def four_layer_llada(tmp_path_factory):
    from vllm_diffusion_lab.fixtures.tiny_llada import build_tiny_llada

    return build_tiny_llada(tmp_path_factory.mktemp("llada-4-layers"), num_layers=4)


# Full attention under Fast-dLLM's dual cache: each policy that decodes there
FULL_ATTENTION_POLICIES = ("standard", "es", "ada", "sparse_prefix")


@pytest.mark.parametrize("policy", FULL_ATTENTION_POLICIES)
def test_generated_requests_on_full_attention_under_the_dual_cache(four_layer_llada, policy):
    """The same property on LLaDA with ``diffusion_cache_mode`` ``dual`` (the options a
    policy cannot take there are refused at admission, which the property allows)."""
    with diffusion_llm(four_layer_llada, diffusion_block_size=BLOCK_SIZE, max_model_len=128,
                       additional_config={"diffusion_policy": policy,
                                          "diffusion_cache_mode": "dual",
                                          "diffusion_canvas_tokens": 4 * BLOCK_SIZE}) as llm:
        reference = list(
            llm.generate(PROMPT, reference_params(), use_tqdm=False)[0].outputs[0].token_ids)
        check_generated_requests(llm, reference, policy)
