"""The pure pieces behind the policy interface, without an engine: block geometry,
planning a step, the batched commit choice against its per-block reference, the policy
registry and the row bookkeeping of the hooks."""

from __future__ import annotations

import itertools
import types

import pytest
import reference_eb_sampler
import torch
from reference_unmasking import choose_commits, factor_count, timestep_quota

from vllm_diffusion.options import OptionError, parse_options
from vllm_diffusion.policies import POLICIES
from vllm_diffusion.capabilities import ModelCapabilities
from vllm_diffusion.policies.base import DecodingPolicy
from vllm_diffusion.policies.focus import FocusConfig, FocusPolicy
from vllm_diffusion.policies.standard import StandardConfig
from vllm_diffusion.policies import rules
from vllm_diffusion.policies.rules import RuleBlocks
from vllm_diffusion.policies.rules import blocks as rule_blocks
from vllm_diffusion.policies.parts.strategy_unmasking import strategy_decision
from vllm_diffusion.policies.rules.timestep_schedule import SCHEDULE_RANKINGS, timesteps
from vllm_diffusion.policies.rules.entropy_bounded import (ENTROPY_BOUNDED_ORDERS,
                                                           entropy_bounded_commits)
from vllm_diffusion.policies.parts.strategy_config import STRATEGIES
from vllm_diffusion.step.hooks import LayerInput
from vllm_diffusion.step.plans import BlockStepPlan, StepBlocks, StepDecision
from vllm_diffusion.step.request import DiffusionRequest
from vllm_diffusion.worker.geometry import BlockGeometry
from vllm_diffusion.worker.step_plan import gather_step, plan_request

MASK = 99


# ------------------------------------------------------------------ geometry
@pytest.mark.parametrize("block", [1, 4, 32])
def test_geometry_committed_prefix(block):
    g = BlockGeometry(block)
    for num_tokens, num_computed in itertools.product(range(0, 70, 3), range(0, 64, block)):
        if num_computed > num_tokens:
            continue
        reach = g.block_end(num_tokens) - num_computed
        assert g.committed_after_step(num_computed, reach, num_tokens) == \
            num_tokens // block * block
        chunk = (num_tokens - num_computed) // 2
        if chunk and num_computed + chunk < num_tokens:  # a partial prefill chunk
            assert g.committed_after_step(num_computed, chunk, num_tokens) == \
                (num_computed + chunk) // block * block


# ------------------------------------------------------------------ planning
class ComputeEven(DecodingPolicy):
    """Test policy: computes the even block positions and recomputes position 0 only at
    commit."""

    name = "compute-even"
    config_cls = StandardConfig

    def new_state(self, config):
        return None

    def plan_step(self, request, start):
        keep = torch.zeros(self.block_size, dtype=torch.bool)
        keep[0] = True
        return BlockStepPlan(compute=torch.arange(self.block_size) % 2 == 0,
                             commit_recompute=keep)

    def decide(self, blocks):
        return StepDecision(blocks.available)  # every available mask


def new_request(policy):
    return DiffusionRequest("r", StandardConfig(), policy.new_state(None), False)


def test_plan_first_step_prefill_and_block():
    policy = ComputeEven(4, MASK, StandardConfig())
    request = new_request(policy)
    tokens = list(range(10))  # prompt of 10: blocks [0,4), [4,8) and tail 8, 9
    rows = plan_request("r", tokens, 0, 12, BlockGeometry(4), MASK, request, policy)
    assert rows.positions == [0, 1, 2, 3, 4, 5, 6, 7, 8, 10]
    assert rows.token_ids == tokens[:8] + [8, MASK]
    assert rows.kv_len == 12 and rows.committed == 8
    assert request.canvas.tokens.tolist() == [8, 9, MASK, MASK]
    assert rows.block_positions.tolist() == [0, 2]


def test_plan_partial_prefill_chunk_has_no_block():
    policy = ComputeEven(4, MASK, StandardConfig())
    request = new_request(policy)
    rows = plan_request("r", list(range(10)), 0, 6, BlockGeometry(4), MASK, request, policy)
    assert rows.positions == [0, 1, 2, 3] and rows.request is None and rows.committed == 4


def test_plan_commit_of_the_completed_block_uses_the_policys_positions():
    policy = ComputeEven(4, MASK, StandardConfig())
    request = new_request(policy)
    geometry = BlockGeometry(4)
    plan_request("r", [1, 2], 0, 4, geometry, MASK, request, policy)  # block [0, 4)
    # The block completed: tokens 1, 2, 5, 6 known; next step commits [0, 4).
    rows = plan_request("r", [1, 2, 5, 6], 0, 8, geometry, MASK, request, policy)
    assert rows.positions == [0, 4, 6]  # commit position 0 only, then block [4, 8) evens
    assert rows.token_ids == [1, MASK, MASK]
    assert request.canvas.start == 4 and request.canvas.first_step == 0


def test_plan_refuses_a_committed_prefix_off_the_block_grid():
    policy = ComputeEven(4, MASK, StandardConfig())
    with pytest.raises(RuntimeError, match="not on a diffusion block boundary"):
        plan_request("r", list(range(10)), 3, 9, BlockGeometry(4), MASK, new_request(policy),
                     policy)


def test_forward_step_block_rows():
    policy = ComputeEven(4, MASK, StandardConfig())
    geometry = BlockGeometry(4)
    a, b = new_request(policy), new_request(policy)
    rows = [plan_request("a", list(range(10)), 0, 12, geometry, MASK, a, policy),
            plan_request("b", list(range(10)), 0, 6, geometry, MASK, b, policy),
            plan_request("c", list(range(5)), 4, 4, geometry, MASK, new_request(policy), policy)]
    step = gather_step(rows, torch.device("cpu"))
    assert step.num_rows == 10 + 4 + 2
    assert step.requests[0].block_rows.tolist() == [8, 9]
    assert step.requests[1].block_rows is None and step.requests[1].rows == range(10, 14)
    assert step.requests[2].block_rows.tolist() == [14, 15]


# ------------------------------------------------------------- commit choice
SDAR = ModelCapabilities(family="SDAR")


def decide_by_rules(requests, confidence, masked, block):
    """The rules' decision (``strategy_decision``) for blocks whose available masks are
    ``masked`` [R, B] (the proposals and tokens play no part in the commits)."""
    tokens = torch.zeros_like(masked, dtype=torch.long)
    return strategy_decision(StepBlocks(requests, confidence, masked, tokens, tokens,
                                        torch.zeros_like(masked)), block, MASK, SDAR)


def random_blocks(seed, rows, block):
    gen = torch.Generator().manual_seed(seed)
    levels = torch.randint(1, 6, (rows, block), generator=gen).float() / 5  # with ties
    masked = torch.rand(rows, block, generator=gen) < 0.6
    masked[0] = False  # nothing left to decode
    masked[1] = True
    # As in the engine: every choosable (masked, computed) position has a probability;
    # the others may be -inf (not computed).
    hidden = ~masked & (torch.rand(rows, block, generator=gen) < 0.5)
    confidence = torch.where(hidden, torch.full_like(levels, float("-inf")), levels)
    return confidence, masked, gen


# name: (rows, block size, seed)
COMMIT_GRID = {"b1": (6, 1, 0), "b4": (24, 4, 1), "b16": (24, 16, 2), "b32": (16, 32, 3),
               "b20": (12, 20, 4)}


@pytest.mark.parametrize("alone", [None, *STRATEGIES])
@pytest.mark.parametrize("name", COMMIT_GRID)
def test_batched_commit_choice_matches_the_per_block_reference(name, alone):
    """Every strategy mixed in one batch (``alone`` None: each rule decides its own
    blocks), and each strategy alone (the engine's common step, one rule's ``step``)."""
    rows, block, seed = COMMIT_GRID[name]
    confidence, masked, gen = random_blocks(seed, rows, block)
    configs = [StandardConfig(
        strategy=alone or STRATEGIES[i % len(STRATEGIES)], threshold=[0.0, 0.5, 0.9, 1.0][i % 4],
        entropy_bound=[0.0, 0.3, 1.5, 100.0][i % 4],
        denoising_steps=None if i % 3 else max(1, block // 2),
        # the schedule ranks by both algs, and the EB-sampler takes both orders, where
        # the grid has 2 rows per strategy
        eps=[1e-3, 0.0, 0.25][i % 3], alg=SCHEDULE_RANKINGS[i // len(STRATEGIES) % 2],
        entropy_bounded_order=ENTROPY_BOUNDED_ORDERS[i // len(STRATEGIES) % 2],
        factor=[1.0, 0.5, 2.0, 0.1][i % 4])
        for i in range(rows)]
    steps = torch.randint(0, block + 2, (rows,), generator=gen)
    entropy = torch.rand(rows, block, generator=gen) * 0.8
    got = rules.choose_commits(RuleBlocks(confidence, masked, steps.tolist(),
                                          [c.steps_for(block) for c in configs], configs,
                                          entropy))
    for i, config in enumerate(configs):
        want = choose_commits(confidence[i], masked[i], int(steps[i]), block, config,
                              entropy[i])
        assert got[i].tolist() == want.tolist(), (i, config)


HOST_ORDER = ("low_confidence_dynamic", "low_confidence_static", "sequential", "threshold")


@pytest.mark.parametrize("alone", [None, *HOST_ORDER])
@pytest.mark.parametrize("name", COMMIT_GRID)
def test_host_commit_choice_matches_the_tensor_path(name, alone, monkeypatch):
    """The small steps' Python commit choice of the rules that have one against their
    tensor path on the same grid (ties, -inf where not computed, last steps), with
    thresholds at the grid's levels, between them, and at values float32 rounds (0.7,
    0.6); the host path forced at every size."""
    rows, block, seed = COMMIT_GRID[name]
    confidence, masked, gen = random_blocks(seed, rows, block)
    confidence[2:4, :] = torch.tensor(0.7)  # exactly the float32 rounding of 0.7
    configs = [StandardConfig(strategy=alone or HOST_ORDER[i % len(HOST_ORDER)],
                              threshold=[0.0, 0.6, 0.7, 0.9, 1.0, 0.55][i % 6],
                              denoising_steps=None if i % 3 else max(1, block // 2))
               for i in range(rows)]
    steps = torch.randint(0, block + 2, (rows,), generator=gen).tolist()
    blocks = RuleBlocks(confidence, masked, steps, [c.steps_for(block) for c in configs],
                        configs)
    want = torch.zeros_like(masked)
    for name_, rule in rules.RULES.items():
        index = [i for i, c in enumerate(configs) if c.strategy == name_]
        if index:
            want[index] = rule.by_tensors(blocks.rows(index))
    monkeypatch.setattr(rule_blocks, "MAX_HOST_POSITIONS", 10 ** 9)
    assert rules.choose_commits(blocks).tolist() == want.tolist()


def test_the_rules_decide_small_steps_on_the_host_and_large_ones_by_tensors():
    """Both sides of ``MAX_HOST_POSITIONS`` give the per-block reference's commits."""
    from vllm_diffusion.policies.rules.blocks import MAX_HOST_POSITIONS

    for rows, block in ((3, 4), (MAX_HOST_POSITIONS // 4 + 1, 4)):
        confidence, masked, _ = random_blocks(7, rows, block)
        configs = [StandardConfig(strategy=HOST_ORDER[i % 4], threshold=0.6)
                   for i in range(rows)]
        requests = []
        for i, config in enumerate(configs):
            request = DiffusionRequest(str(i), config, None, False)
            request.canvas = types.SimpleNamespace(steps=i % 3)
            requests.append(request)
        got = decide_by_rules(requests, confidence, masked, block).commits
        for i, config in enumerate(configs):
            want = choose_commits(confidence[i], masked[i], i % 3, block, config)
            assert got[i].tolist() == want.tolist(), (rows, i, config)


def published_factor_count(sorted_confidence: list[float], factor: float) -> int:
    """Fast-dLLM's ``get_transfer_index_dynamic`` (NVlabs/Fast-dLLM f6b35ec), one row:
    thresholds 1 - factor / (n + 1) over ranks n = 1..m, the first set to -1; the loop
    breaks at the first rank below its threshold; a break at the first or the last
    index, or none, takes one more."""
    thresholds = [1 - factor / (n + 1) for n in range(1, len(sorted_confidence) + 1)]
    thresholds[0] = -1
    for top_i in range(len(thresholds)):
        if sorted_confidence[top_i] < thresholds[top_i]:
            break
    if top_i == 0 or top_i == len(thresholds) - 1:
        top_i += 1
    return top_i


def test_factor_count_is_the_published_dynamic_rule():
    from vllm_diffusion.policies.rules.factor import batched_factor_count

    gen = torch.Generator().manual_seed(5)
    for m in range(1, 12):
        for factor in (0.1, 0.5, 1.0, 2.0, 4.0):
            for _ in range(20):
                ranked = torch.sort(torch.rand(m, generator=gen) ** 0.2, descending=True).values
                want = published_factor_count(ranked.tolist(), factor)
                assert factor_count(ranked, factor) == want, (m, factor, ranked)
                padded = torch.cat([ranked, torch.full((3,), float("-inf"))])[None]
                assert batched_factor_count(padded, torch.tensor([m]),
                                            torch.tensor([factor])).tolist() == [want]
    # two masks left always commit both (a failure at the last rank still commits it)
    assert factor_count(torch.tensor([0.9, 0.01]), 1.0) == 2


@pytest.mark.parametrize("eps", [1e-3, 0.0, 0.3, 1.0])
def test_timestep_quota_is_the_published_transfer_count(eps):
    from reference_dream import transfer_count

    for steps in (1, 2, 3, 7, 8, 16, 33):
        for masked in range(0, 40):
            for step in range(steps):
                assert timestep_quota(masked, step, steps, eps) == transfer_count(
                    masked, step, torch.linspace(1, eps, steps + 1)), (steps, masked, step)
    assert timesteps(4, 1e-3).dtype == torch.float32


def test_scheduled_idle_steps_are_the_zero_quotas_before_the_last():
    """As many steps as masks (8): the first step's quota is int(0.999) = 0, by design;
    the last step commits every mask left; other strategies never idle."""
    def request(strategy, step):
        config = StandardConfig(strategy=strategy, denoising_steps=8)
        return types.SimpleNamespace(policy_config=config,
                                     canvas=types.SimpleNamespace(steps=step))

    masked = torch.ones(4, 8, dtype=torch.bool)
    masked[3] = False  # nothing to choose from: not a scheduled idle step
    requests = [request("timestep_schedule", 0), request("timestep_schedule", 7),
                request("low_confidence_static", 0), request("timestep_schedule", 0)]
    decision = decide_by_rules(requests, torch.rand(4, 8), masked, 8)
    assert decision.idle == [True, False, False, False]
    assert decision.commits.sum(dim=1).tolist() == [0, 8, 1, 0]


def test_sub_blocks_commit_only_in_the_leftmost_one_holding_a_mask():
    """``sub_block_size`` (Fast-dLLM v2's sub-blocks): the threshold strategy commits its
    most confident and above-threshold masked positions of the active sub-block only;
    a block without the option commits over the whole block; the size must divide the
    block."""
    def request(sub_block_size):
        config = StandardConfig(strategy="threshold", threshold=0.5,
                                sub_block_size=sub_block_size)
        return types.SimpleNamespace(policy_config=config,
                                     canvas=types.SimpleNamespace(steps=0))

    confidence = torch.tensor([[0.0, 0.1, 0.6, 0.2, 0.9, 0.95, 0.7, 0.1]]).repeat(3, 1)
    masked = torch.tensor([[False, False, True, True, True, True, True, True]]).repeat(3, 1)
    commits = decide_by_rules([request(4), request(2), request(None)], confidence, masked,
                              8).commits
    assert torch.nonzero(commits[0]).flatten().tolist() == [2]  # sub-block [0, 4)
    assert torch.nonzero(commits[1]).flatten().tolist() == [2]  # sub-block [2, 4)
    assert torch.nonzero(commits[2]).flatten().tolist() == [2, 4, 5, 6]
    masked[0, :4] = False  # sub-block [4, 8) becomes the active one
    commits = decide_by_rules([request(4)], confidence[:1], masked[:1], 8).commits
    assert torch.nonzero(commits[0]).flatten().tolist() == [4, 5, 6]
    with pytest.raises(OptionError, match=r"option 'sub_block_size' must divide the block "
                                          r"size \(8\), got 3"):
        StandardConfig(sub_block_size=3).validate_for_block(8, "request")


@pytest.mark.parametrize("name", COMMIT_GRID)
@pytest.mark.parametrize("gamma", [0.0, 0.05, 0.4, 3.0])
@pytest.mark.parametrize("order", ENTROPY_BOUNDED_ORDERS)
def test_entropy_bounded_commits_match_the_eb_reference(name, gamma, order):
    """The EB-sampler's choice (``entropy_bounded_commits``, the engine's path through
    ``rules.choose_commits``, and the per-block ``choose_commits``) against the plain
    reference of ``reference_eb_sampler``, on the commit grid."""
    rows, block, seed = COMMIT_GRID[name]
    confidence, masked, gen = random_blocks(seed, rows, block)
    # eighths: ties in entropy, and sums exact in float32 (3.0 is reached exactly)
    entropy = torch.randint(0, 6, (rows, block), generator=gen).float() / 8
    bounds = torch.full((rows,), gamma)
    by_confidence = torch.full((rows,), order == "confidence")
    want = reference_eb_sampler.entropy_bounded_commits(confidence, masked, entropy, bounds,
                                                        by_confidence)
    got = entropy_bounded_commits(confidence, masked, entropy, bounds, by_confidence)
    assert got.tolist() == want.tolist()
    config = StandardConfig(strategy="entropy_bounded", entropy_bound=gamma,
                            entropy_bounded_order=order)
    engine = rules.choose_commits(RuleBlocks(confidence, masked, [0] * rows, [block] * rows,
                                             [config] * rows, entropy))
    for i in range(rows):
        if block > 1:  # a one-position block's first step is its last: everything commits
            assert engine[i].tolist() == want[i].tolist(), (i, gamma)
        assert choose_commits(confidence[i], masked[i], 0, block, config,
                              entropy[i]).tolist() == engine[i].tolist()


def test_entropy_bounded_takes_the_lowest_entropies_first_unless_told_confidence():
    """Position 3 has the lowest entropy and the lowest confidence: by entropy (the
    default) 3, 1 and 2 fit the bound (the entropies before 2 sum to 0.06); by confidence
    0 comes first and 2's entropy already exceeds the bound."""
    confidence = torch.tensor([0.9, 0.5, 0.6, 0.4])
    entropy = torch.tensor([0.3, 0.05, 0.2, 0.01])
    masked = torch.ones(4, dtype=torch.bool)
    default = StandardConfig(strategy="entropy_bounded", entropy_bound=0.1)
    assert default.entropy_bounded_order == "entropy"
    assert choose_commits(confidence, masked, 0, 4, default, entropy).tolist() == [
        False, True, True, True]
    by_confidence = StandardConfig(strategy="entropy_bounded", entropy_bound=0.1,
                                   entropy_bounded_order="confidence")
    assert choose_commits(confidence, masked, 0, 4, by_confidence, entropy).tolist() == [
        True, False, False, False]
    for flag, config in ((False, default), (True, by_confidence)):
        assert reference_eb_sampler.entropy_bounded_commits(
            confidence[None], masked[None], entropy[None], torch.tensor([0.1]),
            torch.tensor([flag]))[0].tolist() == choose_commits(
            confidence, masked, 0, 4, config, entropy).tolist()
    with pytest.raises(OptionError, match=r"option 'entropy_bounded_order' must be one of "
                                          r"'entropy', 'confidence', got 'margin'"):
        parse_options(StandardConfig, {"entropy_bounded_order": "margin"}, source="request")


# ---------------------------------------------------------------- registry
def test_registry_and_interface():
    assert set(POLICIES) == {"standard", "focus", "elastic", "es", "ada", "sparse_prefix"}
    for name, cls in POLICIES.items():
        assert issubclass(cls, DecodingPolicy) and cls.name == name
    three_layers, four_layers = (types.SimpleNamespace(num_hidden_layers=n) for n in (3, 4))
    with pytest.raises(ValueError, match="evicts after layer 3"):
        FocusPolicy(4, MASK, FocusConfig(eviction_layer=3)).bind(SDAR, three_layers, False)
    with pytest.raises(ValueError, match="prefix cache"):
        FocusPolicy(4, MASK, FocusConfig(commit="delayed")).bind(SDAR, four_layers, True)
    # the interface: what the runner calls, and nothing else public
    public = {name for name, value in vars(DecodingPolicy).items()
              if not name.startswith("_") and callable(getattr(DecodingPolicy, name))}
    assert public == {"bind", "new_state", "begin_step", "plan_step", "forward_hooks",
                      "decide", "after_step", "counters"}
    # what a policy does with its options is its options' to say
    assert FocusConfig.traits({"evict": False}).skips_rows is False
    assert FocusConfig.traits({}).skips_rows is True


def test_layer_input_maps_step_rows_to_current_rows():
    untouched = LayerInput(0, torch.arange(6))
    assert untouched.current_rows(torch.tensor([2, 5])).tolist() == [2, 5]
    compacted = LayerInput(3, torch.tensor([0, 2, 3, 5]))
    assert compacted.current_rows(torch.tensor([2, 5])).tolist() == [1, 3]
    with pytest.raises(RuntimeError, match="dropped"):
        compacted.current_rows(torch.tensor([1]))
