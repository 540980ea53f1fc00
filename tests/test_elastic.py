"""Elastic chunk-size scheduling: the latency model's fit, the chunk choice against load
with a synthetic profile, and the policy in the engine (profile loaded and checked)."""

from __future__ import annotations

import json

import pytest
from conftest import diffusion_llm

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

from vllm_diffusion.policies.elastic.chunk_statistics import (
    STAGES,
    ChunkStatistics,
    StepRecord,
    output_masks,
    stage_of,
    window_outcomes,
)
from vllm_diffusion.policies.elastic import ElasticConfig, ElasticPolicy
from vllm_diffusion.policies.elastic.latency_model import (LatencyProfile, OnlineLatency,
                                                           fit_piecewise)
from vllm_diffusion.step.request import OutputBounds
from vllm_diffusion_lab.offline import stats_delta

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


class Canvas:
    """A stand-in for a request's canvas with ``masked`` undecided positions."""

    def __init__(self, block: int, masked: int) -> None:
        import torch

        self.tokens = torch.zeros(block, dtype=torch.long)
        self.tokens[:masked] = 3

    def masked(self, mask_token_id: int):
        return self.tokens == mask_token_id


def requests_at(count: int, block: int, masked: int) -> list:
    import types

    return [types.SimpleNamespace(req_id=str(i), canvas=Canvas(block, masked))
            for i in range(count)]


def test_chosen_chunk_follows_load():
    policy = ElasticPolicy(32, 3, ElasticConfig(warmup_steps=0, explore_every=10_000))
    policy.latency = OnlineLatency(MODEL, warm_start=saturating_profile(capacity=128))
    # Observed: commits grow with the chunk, with diminishing returns; rows = chunk.
    for chunk, commits in ((1, 1.0), (2, 1.6), (4, 2.2), (8, 2.8), (16, 3.2), (32, 3.5)):
        for _ in range(10):
            policy.statistics.observe(chunk, 0, commits, chunk)
    chosen = {batch: policy.choose_chunk(requests_at(batch, 32, 32))
              for batch in (1, 2, 4, 8, 16, 32, 64)}
    # Idle machine: the whole block (most commits per step, same latency); saturated:
    # ever smaller chunks; never larger when the load grows.
    assert chosen[1] == 32 and chosen[64] <= 4
    sizes = [chosen[b] for b in sorted(chosen)]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) >= 3


def test_a_nearly_done_block_does_not_move_the_choice():
    policy = ElasticPolicy(32, 3, ElasticConfig(warmup_steps=0, explore_every=10_000))
    policy.latency = OnlineLatency(MODEL, warm_start=saturating_profile(capacity=4096))
    # Late in blocks, larger windows were seen committing more (as when they hold more
    # undecided positions); a block with 2 left computes 2 whatever the chunk.
    for chunk in policy.candidates:
        for _ in range(20):
            policy.statistics.observe(chunk, STAGES - 1, 1 + chunk / 4, chunk)
    policy.step_chunk = 8
    assert policy.choose_chunk(requests_at(64, 32, 2)) == 8  # every size >= 2 is the same


def test_estimates_follow_the_stage_and_interpolate_between_sizes():
    statistics = ChunkStatistics()
    for _ in range(20):
        statistics.observe(4, 0, 1, 4)  # early in a block: one commit per step
        statistics.observe(4, 3, 3, 4)  # late: three
        statistics.observe(8, 0, 2, 8)
    sizes = [4, 6, 8]
    assert statistics.estimates(0, sizes, 16)[4] == (1.0, 4.0)
    assert statistics.estimates(3, sizes, 16)[4] == (3.0, 4.0)
    assert statistics.estimates(1, sizes, 16)[4] == (2.0, 4.0)  # the size over its stages
    # 6, never observed: halfway between 4 (1 commit at stage 0) and 8 (2, 8 rows)
    assert statistics.estimates(0, sizes, 16)[6] == (1.5, 6.0)
    assert stage_of(16, 16) == 0 and stage_of(1, 16) == STAGES - 1


def test_a_size_seen_in_other_stages_is_scaled_to_the_stage():
    statistics = ChunkStatistics()
    for _ in range(20):
        statistics.observe(4, 0, 1, 4)
        statistics.observe(4, 3, 3, 4)  # size 4: 1 early, 3 late, 2 over both
        statistics.observe(8, 0, 2, 8)
        statistics.observe(16, 3, 6, 10)  # size 16: seen late only
    # At stage 0 the sizes seen there commit 60 where their means predict 80: 16's late
    # mean of 6 counts 4.5 early, not 6 (unscaled, 16 would look three times 8).
    commits, rows = statistics.estimates(0, [4, 8, 16], 16)[16]
    assert commits == pytest.approx(4.5)
    assert rows == pytest.approx(10 * (20 * 4 + 20 * 8) / (20 * 4 + 20 * 8))


def test_commit_estimates_never_fall_as_the_chunk_grows():
    statistics = ChunkStatistics()
    for _ in range(20):
        statistics.observe(4, 0, 3, 4)  # noise: 4 seen committing more than 8
        statistics.observe(8, 0, 2, 8)
    estimates = statistics.estimates(0, [4, 8], 8)
    assert estimates[4][0] == estimates[8][0] == pytest.approx(2.5)


def test_warmup_and_exploration_move_one_request_only():
    policy = ElasticPolicy(16, 3, ElasticConfig(warmup_steps=2, explore_every=4))
    policy.latency = OnlineLatency(MODEL, warm_start=saturating_profile(capacity=1))
    requests = requests_at(8, 16, 16)
    chosen, explored = [], []
    for _ in range(8):
        policy.begin_step(requests)
        chosen.append(policy.step_chunk)
        explored.append(dict(policy.explored))
        policy.statistics.observe(policy.step_chunk, 0, 1, policy.step_chunk)
    assert chosen[:2] == [16, 16]  # warm-up at the whole block
    # Every 4th step one request tries the least observed size; the rest keep the choice.
    assert [len(e) for e in explored] == [0, 0, 0, 1, 0, 0, 0, 1]
    assert list(explored[3].values())[0] not in chosen[:4]
    assert list(explored[3]) != list(explored[7])  # another request's turn


def test_a_pinned_chunk_is_neither_chosen_nor_explored():
    """A request's ``chunk_size`` is its chunk at every step, whatever the step's choice
    and whoever's turn it is to explore; the unpinned request follows them."""
    import types

    import torch

    from vllm_diffusion.step.request import BlockCanvas

    policy = ElasticPolicy(16, MASK, ElasticConfig(warmup_steps=0, explore_every=2,
                                                   chunk_reuse=False))
    policy.latency = OnlineLatency(MODEL, warm_start=saturating_profile(capacity=1))

    def request(req_id, pin):
        return types.SimpleNamespace(
            req_id=req_id, canvas=BlockCanvas(0, torch.full((16,), MASK)),
            policy_state=policy.new_state(None),
            policy_config=ElasticConfig(chunk_reuse=False, chunk_size=pin))

    pinned, free = request("pinned", 4), request("free", None)
    moved = set()
    for _ in range(8):
        policy.begin_step([pinned, free])
        policy.statistics.observe(policy.step_chunk, 0, 1, policy.step_chunk)
        policy.plan_step(pinned, None)
        policy.plan_step(free, None)
        assert pinned.policy_state.chunk == 4
        moved.add(free.policy_state.chunk)
    assert len(moved) > 1  # the unpinned request's chunk did move


def test_a_pinned_chunk_is_validated_per_request():
    from vllm_diffusion.config import DiffusionEngineConfig
    from vllm_diffusion.options import OptionError

    engine = DiffusionEngineConfig("elastic", 8, MASK, ElasticConfig())
    assert engine.request_policy_config({"chunk_size": 2}).chunk_size == 2
    assert engine.request_policy_config({"chunk_size": 8}).chunk_size == 8
    for value, message in ((3, r"option 'chunk_size' must divide the block size \(8\), "
                               r"got 3"),
                           (16, r"option 'chunk_size' must divide the block size \(8\), "
                                r"got 16"),
                           (0, r"option 'chunk_size' must be int in \[1, 1024\] or null, "
                               r"got 0"),
                           ("two", r"option 'chunk_size' must be int in \[1, 1024\] or "
                                   r"null, got 'two'"),
                           (2.5, r"option 'chunk_size' must be int .* got 2.5")):
        with pytest.raises(OptionError, match=message):
            engine.request_policy_config({"chunk_size": value})


MASK = 3


def record(masked: str, committed: str, computed: str, chunk: int, reuse: bool = True,
           start: int = 0, tokens: list[int] | None = None,
           bounds: OutputBounds = OutputBounds()) -> StepRecord:
    """A request-step from strings of 0/1 per block position (committed positions hold
    token 5 unless ``tokens`` says otherwise)."""
    import torch

    def bits(text: str):
        return torch.tensor([c == "1" for c in text])

    after = torch.where(bits(masked) & ~bits(committed), MASK, 5)
    if tokens is not None:
        after = torch.tensor(tokens)
    return StepRecord(bits(masked), after, bits(computed), start, bounds, chunk, reuse)


def test_output_bounds_mark_the_positions_that_can_be_output():
    # block of 8 at absolute position 20 with EOS (id 2) at position 3
    tokens = [5, 6, 9, 2, 2, 2, 9, 9]
    cases = [(OutputBounds(frozenset({2}), None), 4),  # up to the first stop, inclusive
             (OutputBounds(frozenset(), None), 8),  # ignore_eos
             (OutputBounds(frozenset(), 25), 5),  # max_tokens ends at position 25
             (OutputBounds(frozenset({2}), 22), 2),
             (OutputBounds(frozenset(), 10), 0)]
    records = [record("0" * 8, "0" * 8, "1" * 8, 8, start=20, tokens=tokens, bounds=bounds)
               for bounds, _ in cases]
    masks = output_masks(records)
    for (_, expected), mask in zip(cases, masks):
        assert mask.tolist() == [True] * expected + [False] * (8 - expected)


def test_a_step_shows_what_every_smaller_window_would_have_done():
    # block of 8: positions 0-1 decoded (1 in the processing set, recomputed), 2-7
    # undecided; the whole-block step committed 3, 4 and 6; all can be output
    whole = record("00111111", "00011010", "01111111", 8)
    outcomes = window_outcomes([whole], [1, 2, 4, 8], 8, MASK)
    # (steps, output commits, rows) per size, stage 1 (6 of 8 undecided)
    assert outcomes[(1, 1)] == (1, 1, 2)  # window {2}: nothing confident, one commit
    assert outcomes[(2, 1)] == (1, 1, 3)  # {2, 3}: commits 3
    assert outcomes[(4, 1)] == (1, 2, 5)  # {2..5}: 3 and 4
    assert outcomes[(8, 1)] == (1, 3, 7)  # the step itself
    # a window of 2 shows sizes 1 and 2 only; without reuse the decoded positions left
    # of the window count as rows; positions past the output (max_tokens ends it at
    # position 3) count as no commit
    chunk = record("00111111", "00010000", "11110000", 2, reuse=False,
                   bounds=OutputBounds(frozenset(), 3))
    outcomes = window_outcomes([chunk], [1, 2, 4, 8], 8, MASK)
    assert set(outcomes) == {(1, 1), (2, 1)}
    assert outcomes[(1, 1)] == (1, 1, 3) and outcomes[(2, 1)] == (1, 1, 4)
    statistics = ChunkStatistics()
    statistics.learn([whole] * 16, [1, 2, 4, 8], 8, MASK)
    assert statistics.estimates(1, [4], 8)[4] == (2.0, 5.0)


def test_elastic_records_its_steps_and_a_done_block_starts_anew():
    import types

    import torch

    from vllm_diffusion.step.request import BlockCanvas

    policy = ElasticPolicy(8, MASK, ElasticConfig(chunk_reuse=False))
    # the step committed all 8 positions, EOS (id 2) at position 1: two are output
    canvas = BlockCanvas(0, torch.tensor([7, 2, 2, 2, 2, 2, 2, 2]))
    state = types.SimpleNamespace(chunk=None, after_step=lambda *args: None)
    request = types.SimpleNamespace(canvas=canvas, policy_state=state,
                                    policy_config=ElasticConfig(chunk_reuse=False),
                                    bounds=OutputBounds(frozenset({2}), None))
    policy.after_step(request, torch.ones(8, dtype=torch.bool), torch.ones(8, dtype=torch.bool), 8,
                      True)
    canvas.tokens[:] = MASK  # the record keeps the block as the step left it
    policy.statistics.learn(policy.records, [8], 8, MASK)
    assert policy.statistics.commits[(8, 0)] == 2 and policy.statistics.rows[(8, 0)] == 8
    # nothing masked left: the next step starts a new block, in the first stage
    canvas.tokens[:] = 7
    later = types.SimpleNamespace(canvas=Canvas(8, 1))
    counts = policy.undecided_counts([request, later, types.SimpleNamespace(canvas=None)])
    assert [stage_of(u, 8) for u in counts] == [
        0, STAGES - 1, 0]


def test_the_online_latency_model_learns_three_regimes_and_reports_its_error():
    import random

    truth = LatencyProfile(model=MODEL, breaks=(100, 400), slopes=(1e-5, 1e-4, 3e-4),
                           intercepts=(0.010, 0.0011, -0.0789))
    online = OnlineLatency(MODEL)
    rng = random.Random(0)
    assert not online.ready and online.held_out_error() is None
    for _ in range(600):
        rows = rng.uniform(10, 800)
        online.observe(rows, truth.seconds(rows) * rng.uniform(0.97, 1.03))
    online.observe(500, 100.0)  # an idle gap: dropped
    assert online.ready and online.held_out_error() < 0.05
    for rows in (20, 250, 700):
        assert online.seconds(rows) == pytest.approx(truth.seconds(rows), rel=0.08)
    warm = OnlineLatency(MODEL, warm_start=truth)
    assert warm.ready and warm.seconds(250) == truth.seconds(250)


def write_profile(path, model_identity) -> str:
    profile = LatencyProfile(model=model_identity, breaks=(64, 512), slopes=(1e-5, 2e-4, 3e-4),
                             intercepts=(0.01, 0.0, -0.05))
    path.write_text(profile.to_json())
    return str(path)


@pytest.mark.engine
def test_elastic_policy_in_the_engine(dense_checkpoint, tmp_path):
    """No options needed: the latency model is learned from the steps (a profile of
    another model is still refused); sizes other than powers of two are tried; the chosen
    chunks and the model's held-out error are reported."""
    config = json.loads((dense_checkpoint / "config.json").read_text())
    identity = {k: config.get(k) for k in ("architectures", "hidden_size", "num_hidden_layers",
                                           "num_attention_heads", "num_key_value_heads",
                                           "intermediate_size", "vocab_size")}
    other = write_profile(tmp_path / "other.json", {**identity, "hidden_size": 4096})
    with pytest.raises(Exception, match="measured for another model"):
        with diffusion_llm(dense_checkpoint, diffusion_block_size=8, additional_config={
                "diffusion_policy": "elastic", "latency_profile": other}):
            pass
    with diffusion_llm(dense_checkpoint, diffusion_block_size=8, max_num_seqs=16,
                       additional_config={"diffusion_policy": "elastic",
                                          "explore_every": 2}) as llm:
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        outputs = llm.generate([[5, 6, 7, 8 + i] for i in range(16)], params, use_tqdm=False)
        fixed = llm.generate([[5, 6, 7, 8]], SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, extra_args={"chunk_size": 2}),
            use_tqdm=False)
        stats = llm.collective_rpc("diffusion_stats")[0]
        delta = stats_delta(llm.collective_rpc("diffusion_stats")[0], stats)
        runner = (llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
                  .worker.model_runner)
        tried = {c for c in range(1, 9) if runner.policy.statistics.observed_steps(c)}
    assert all(len(o.outputs[0].token_ids) == 48 for o in outputs)
    assert len(fixed[0].outputs[0].token_ids) == 24
    assert len(tried) >= 3 and tried - {1, 2, 4, 8}  # beyond the powers of two
    chosen = stats["elastic_chunk_steps"]
    # One size is chosen, and counted, per engine step that runs requests: the steps per
    # size add up to the runner's own step count, and every size is a candidate.
    assert sum(chosen.values()) == stats["engine_steps"]
    assert set(chosen) <= set(runner.policy.candidates)
    # The warm-up steps (8 by default) decode whole blocks before any choice is made.
    assert chosen.get(8, 0) >= ElasticConfig().warmup_steps
    assert stats["latency_observations"] > 8 and stats["latency_held_out_error"] is not None
    # the policy's counters difference like the engine's (a dict per chunk, the error kept)
    assert set(delta["elastic_chunk_steps"].values()) == {0}
    assert delta["latency_held_out_error"] == stats["latency_held_out_error"]


@pytest.mark.engine
def test_identical_greedy_requests_with_a_pinned_chunk_ignore_the_load(dense_checkpoint):
    """Greedy requests with the same ``chunk_size`` give the same output alone and beside
    a load whose chunks the policy chooses and explores (the load did move them: several
    sizes were decoded at); a bad pin is refused per request."""
    pinned = [[5, 6, 7, 8], [9, 10]]
    load = [[11, 12, 13 + i] for i in range(12)]
    unpinned = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with diffusion_llm(dense_checkpoint, diffusion_block_size=8, max_num_seqs=16,
                       additional_config={"diffusion_policy": "elastic",
                                          "explore_every": 2}) as llm:
        runner = (llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
                  .worker.model_runner)
        for pin in (2, 8):
            params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                    extra_args={"chunk_size": pin})
            alone = [list(o.outputs[0].token_ids)
                     for o in llm.generate(pinned, params, use_tqdm=False)]
            loaded = llm.generate(pinned * 2 + load, [params] * 4 + [unpinned] * len(load),
                                  use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in loaded[:4]] == alone * 2
            assert all(len(tokens) == 24 for tokens in alone)
        tried = {c for c in range(1, 9) if runner.policy.statistics.observed_steps(c)}
        with pytest.raises(VLLMValidationError, match="option 'chunk_size' must divide "
                                                      "the block size"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4,
                                                     extra_args={"chunk_size": 3}),
                         use_tqdm=False)
    assert len(tried - {2, 8}) >= 1
