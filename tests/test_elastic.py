"""Elastic chunk-size scheduling: the latency model's fit, the chunk choice against load
with a synthetic profile, and the policy in the engine (profile loaded and checked)."""

from __future__ import annotations

import json

import pytest
from conftest import diffusion_llm

from vllm import SamplingParams

from vllm_diffusion.policies.elastic import ElasticPolicy, ElasticConfig
from vllm_diffusion.policies.latency_model import LatencyProfile, fit_piecewise

MODEL = {"architectures": ["SDARForCausalLM"]}


def saturating_profile(capacity: float) -> LatencyProfile:
    """10 ms per step up to ``capacity`` rows, then 0.5 ms per extra row."""
    return LatencyProfile(model=MODEL, breaks=(capacity, capacity * 2),
                          slopes=(0.0, 5e-4, 5e-4),
                          intercepts=(0.01, 0.01 - 5e-4 * capacity, 0.01 - 5e-4 * capacity))


def test_fit_recovers_three_regimes():
    truth = LatencyProfile(model=MODEL, breaks=(100, 400), slopes=(1e-5, 1e-4, 3e-4),
                           intercepts=(0.010, 0.0011, -0.0789))
    samples = [(x, truth.seconds(x)) for x in range(10, 800, 10)]
    fitted = fit_piecewise(samples, MODEL)
    # At x = 400 the two upper regimes meet, so either side may take that sample.
    assert fitted.breaks[0] == 100 and 400 <= fitted.breaks[1] <= 410
    for x in range(10, 800, 10):
        assert fitted.seconds(x) == pytest.approx(truth.seconds(x), rel=1e-6)


def test_chosen_chunk_follows_load():
    policy = ElasticPolicy(32, 3, ElasticConfig(warmup_steps=0, explore_every=10_000))
    policy.profile = saturating_profile(capacity=128)
    # Observed: commits grow with the chunk, with diminishing returns; rows = chunk.
    for chunk, commits in ((1, 1.0), (2, 1.6), (4, 2.2), (8, 2.8), (16, 3.2), (32, 3.5)):
        for _ in range(10):
            policy.statistics.observe(chunk, commits, chunk)
    chosen = {batch: policy.choose_chunk(batch) for batch in (1, 2, 4, 8, 16, 32, 64)}
    # Idle machine: the whole block (most commits per step, same latency); saturated:
    # ever smaller chunks; never larger when the load grows.
    assert chosen[1] == 32 and chosen[64] <= 4
    sizes = [chosen[b] for b in sorted(chosen)]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) >= 3


def test_warmup_and_exploration():
    policy = ElasticPolicy(16, 3, ElasticConfig(warmup_steps=2, explore_every=4))
    policy.profile = saturating_profile(capacity=1)
    chosen = []
    for _ in range(8):
        policy.begin_step([object()] * 8)
        chosen.append(policy.step_chunk)
        policy.statistics.observe(policy.step_chunk, 1, policy.step_chunk)
    assert chosen[:2] == [16, 16]  # warm-up at the whole block
    # Every 4th step tries a size never tried so far (the least observed).
    assert chosen[3] not in chosen[:3] and chosen[7] not in chosen[:7]


def write_profile(path, model_identity) -> str:
    profile = LatencyProfile(model=model_identity, breaks=(64, 512), slopes=(1e-5, 2e-4, 3e-4),
                             intercepts=(0.01, 0.0, -0.05))
    path.write_text(profile.to_json())
    return str(path)


@pytest.mark.engine
def test_elastic_policy_in_the_engine(dense_checkpoint, tmp_path):
    config = json.loads((dense_checkpoint / "config.json").read_text())
    identity = {k: config.get(k) for k in ("architectures", "hidden_size", "num_hidden_layers",
                                           "num_attention_heads", "num_key_value_heads",
                                           "intermediate_size", "vocab_size")}
    good = write_profile(tmp_path / "good.json", identity)
    other = write_profile(tmp_path / "other.json", {**identity, "hidden_size": 4096})
    with pytest.raises(Exception, match="measured for another model"):
        with diffusion_llm(dense_checkpoint, diffusion_block_size=8, additional_config={
                "diffusion_policy": "elastic", "latency_profile": other}):
            pass
    with pytest.raises(Exception, match="needs option 'latency_profile'"):
        with diffusion_llm(dense_checkpoint, diffusion_block_size=8, additional_config={
                "diffusion_policy": "elastic"}):
            pass
    with diffusion_llm(dense_checkpoint, diffusion_block_size=8, max_num_seqs=16,
                       additional_config={"diffusion_policy": "elastic", "latency_profile": good,
                                          "warmup_steps": 2, "explore_every": 3}) as llm:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        outputs = llm.generate([[5, 6, 7, 8 + i] for i in range(16)], params, use_tqdm=False)
        fixed = llm.generate([[5, 6, 7, 8]], SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, extra_args={"chunk_size": 2}),
            use_tqdm=False)
        runner = (llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
                  .worker.model_runner)
        tried = {c for c, n in runner.policy.statistics.steps.items() if n}
    assert all(len(o.outputs[0].token_ids) == 24 for o in outputs + fixed)
    assert len(tried) >= 2  # the whole block at warm-up, then chosen or explored sizes
