"""ES-dLLM (``es``) and Ada-DLM (``ada``) in the engine: token for token equal to the plain
PyTorch references of their papers' algorithms on the SDAR reference loop, ``es`` without
skipping equal to ``standard``, less work through the later layers / fewer positions
computed, validated options, and no state left behind by preemption or abort."""

from __future__ import annotations

import gc
import math
import random
import weakref

import pytest
import torch
from conftest import diffusion_llm, outputs_with_and_without_room, watch_preemptions
from reference_early_skip import reference_ada_generate, reference_es_generate
from reference_sdar import ReferenceSDAR, reference_generate
from test_parity import checkpoint_info, make_prompts

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from vllm_diffusion.policies.es import default_skip_layers
from vllm_diffusion_lab.fixtures.tiny_sdar import build_tiny_sdar
from vllm_diffusion_lab.offline import stats_delta

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def four_layer_checkpoint(tmp_path_factory):
    return build_tiny_sdar(tmp_path_factory.mktemp("sdar-4-layers"), num_layers=4, seed=3)


def run(checkpoint, block_size, prompts, policy, extra_args, max_tokens, engine_options=None):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args=extra_args)
    with diffusion_llm(checkpoint, diffusion_block_size=block_size,
                       additional_config={"diffusion_policy": policy,
                                          **(engine_options or {})}) as llm:
        before = llm.collective_rpc("diffusion_stats")[0]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               use_tqdm=False)
        stats = stats_delta(before, llm.collective_rpc("diffusion_stats")[0])
    return [list(o.outputs[0].token_ids) for o in outputs], stats


def test_default_skip_layers_follow_the_papers_depths():
    assert default_skip_layers(32) == (4, 8)  # LLaDA-8B, as in the paper
    assert default_skip_layers(28) == (4, 7)  # Dream-7B
    assert default_skip_layers(12) == (2, 3)
    assert default_skip_layers(4) == (2,)
    assert default_skip_layers(3) == ()


@pytest.mark.parametrize("strategy", ["threshold", "low_confidence_dynamic"])
def test_es_without_skipping_equals_standard(dense_checkpoint, strategy):
    block_size = 8
    mask_id, stops, vocab_size = checkpoint_info(dense_checkpoint)
    prompts = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=41)
    options = {"strategy": strategy, "threshold": 0.7}
    got, stats = run(dense_checkpoint, block_size, prompts, "es",
                     {**options, "skip_ratio": 0.0}, 3 * block_size,
                     engine_options={"skip_layers": [0]})
    reference = ReferenceSDAR(dense_checkpoint)
    for prompt, tokens in zip(prompts, got):
        assert tokens == reference_generate(reference, prompt, block_size=block_size,
                                            mask_id=mask_id, max_tokens=3 * block_size,
                                            **options)
    assert stats["block_positions_per_layer"] == [stats["block_positions_computed"]] * 2


# (block size, skip layers, refresh period, keep floor, priority bonuses)
ES_GRID = {
    "b8-paper-defaults": (8, None, 4, True, True),
    "b16-refresh3": (16, None, 3, True, True),
    "b16-layers1,2-no-refresh": (16, [1, 2], None, True, True),
    "b16-equations-only": (16, None, None, False, False),
    "b16-floor-without-bonuses": (16, [1, 2], 8, True, False),
}


@pytest.mark.parametrize("case", ES_GRID.values(), ids=ES_GRID.keys())
def test_es_equals_the_es_reference(four_layer_checkpoint, case):
    block_size, skip_layers, refresh_period, keep_floor, bonuses = case
    checkpoint = four_layer_checkpoint
    mask_id, stops, vocab_size = checkpoint_info(checkpoint)
    prompts = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=50 + block_size)
    options = {"strategy": "low_confidence_dynamic", "threshold": 0.5, "alpha": 0.5,
               "skip_ratio": 0.5, "refresh_period": refresh_period, "keep_floor": keep_floor,
               "priority_bonuses": bonuses}
    engine = {"skip_layers": skip_layers} if skip_layers else {}
    got, stats = run(checkpoint, block_size, prompts, "es", options, 3 * block_size, engine)
    layers = tuple(skip_layers or default_skip_layers(4))
    reference = ReferenceSDAR(checkpoint)
    for prompt, tokens in zip(prompts, got):
        want = reference_es_generate(reference, prompt, block_size=block_size, mask_id=mask_id,
                                     max_tokens=3 * block_size, skip_layers=layers, **options)
        assert tokens == want
    per_layer = stats["block_positions_per_layer"]
    assert per_layer[0] == stats["block_positions_computed"]
    assert per_layer[layers[0]] == per_layer[0]  # skipping starts after the skip layer
    assert per_layer[-1] < per_layer[0]
    assert per_layer[-1] == stats["block_positions_after_eviction"]


def test_the_papers_configurations_are_the_defaults():
    """ES-dLLM: alpha = r = 0.5 (section 6.1), the block refresh every 4 steps (Table 5),
    the authors' safeguards on; Ada-DLM: K = 15% of the block, frozen positions computed
    once more with their token and then reused; the keep count rounds (1 - 0.8) * 10 to 2,
    not to the 1 binary floats give."""
    from vllm_diffusion.policies.ada import AdaConfig, capacity_count
    from vllm_diffusion.policies.es import EsConfig, keep_count
    from reference_early_skip import es_keep_count

    es = EsConfig()
    assert (es.alpha, es.skip_ratio, es.refresh_period, es.keep_floor,
            es.priority_bonuses) == (0.5, 0.5, 4, True, True)
    ada = AdaConfig()
    assert (ada.capacity, ada.history, ada.freeze_rule) == (0.15, 3, "after_recompute")
    assert capacity_count(ada.capacity, 32) == 5 and capacity_count(ada.capacity, 4) == 1
    assert math.floor((1 - 0.8) * 10) == 1  # the float trap
    for args in [(10, 1, 0.8, 0, False), (32, 2, 0.5, 0, False), (32, 2, 0.5, 9, True),
                 (4, 2, 0.5, 0, True), (7, 1, 0.5, 1, True), (3, 1, 0.9, 0, False)]:
        assert keep_count(*args) == es_keep_count(*args)
    assert keep_count(10, 1, 0.8, 0, False) == 2
    assert keep_count(32, 2, 0.5, 0, False) == 8  # the cumulative share 0.25
    assert keep_count(32, 2, 0.5, 9, True) == 11  # the floor: decoded last step + 2


def test_es_on_moe_equals_the_es_reference(moe_checkpoint):
    block_size = 8
    mask_id, stops, vocab_size = checkpoint_info(moe_checkpoint)
    prompts = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=57)
    options = {"strategy": "threshold", "threshold": 0.6, "alpha": 0.3, "skip_ratio": 0.6}
    got, _ = run(moe_checkpoint, block_size, prompts, "es", options, 2 * block_size,
                 {"skip_layers": "0"})
    reference = ReferenceSDAR(moe_checkpoint)
    for prompt, tokens in zip(prompts, got):
        assert tokens == reference_es_generate(reference, prompt, block_size=block_size,
                                               mask_id=mask_id, max_tokens=2 * block_size,
                                               skip_layers=(0,), **options)


@pytest.mark.parametrize("block_size,capacity,history,cache,freeze_rule,floor,static", [
    (8, 0.15, 3, True, "after_recompute", 0.0, None),
    (16, 0.15, 3, True, "after_recompute", 0.0, None),
    (16, 0.5, 1, True, "after_recompute", 0.4, None),
    (4, 1.0, 3, True, "after_recompute", 0.0, None),
    (16, 0.15, 3, False, "after_recompute", 0.0, None),
    (16, 0.15, 3, False, "after_recompute", 0.6, 0.3),
    (16, 0.15, 3, True, "after_neighbour", 0.0, None),
    (8, 0.3, 2, True, "immediate", 0.0, None)])
def test_ada_equals_the_ada_reference(four_layer_checkpoint, block_size, capacity, history,
                                      cache, freeze_rule, floor, static):
    checkpoint = four_layer_checkpoint
    mask_id, stops, vocab_size = checkpoint_info(checkpoint)
    prompts = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=60 + block_size)
    options = {"capacity": capacity, "history": history, "intra_block_cache": cache,
               "freeze_rule": freeze_rule, "confidence_floor": floor,
               "static_threshold": static}
    got, stats = run(checkpoint, block_size, prompts, "ada", options, 3 * block_size)
    reference = ReferenceSDAR(checkpoint)
    for prompt, tokens in zip(prompts, got):
        assert tokens == reference_ada_generate(reference, prompt, block_size=block_size,
                                                mask_id=mask_id, max_tokens=3 * block_size,
                                                **options)
    # Frozen positions are not recomputed (at once, or once their right neighbour is).
    whole_blocks = stats["denoising_steps"] * block_size
    assert (stats["block_positions_computed"] < whole_blocks if cache
            else stats["block_positions_computed"] == whole_blocks)


def test_es_and_ada_options_are_validated(four_layer_checkpoint, dense_checkpoint):
    from vllm.exceptions import VLLMValidationError

    rejected = (ValueError, VLLMValidationError)
    with diffusion_llm(four_layer_checkpoint, diffusion_block_size=8,
                       additional_config={"diffusion_policy": "es"}) as llm:
        for extra, message in (({"skip_ratio": 1.0}, r"'skip_ratio' must be below 1"),
                               ({"alpha": 1.5}, r"'alpha' must be float in \[0.0, 1.0\]"),
                               ({"skip_layers": "1"}, r"'skip_layers' is engine-wide"),
                               ({"capacity": 0.2}, r"unknown option.*'capacity'")):
            with pytest.raises(rejected, match=message):
                llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]),
                             SamplingParams(max_tokens=4, extra_args=extra), use_tqdm=False)
    for engine, message in (({"skip_layers": [3]}, r"skipping after layer 3 needs a later"),
                            ({"skip_layers": [2, 1]}, r"distinct layers in increasing order"),
                            ({"skip_layers": "x"}, r"'skip_layers' must be int")):
        with pytest.raises(Exception, match=message):
            with diffusion_llm(four_layer_checkpoint, diffusion_block_size=8,
                               additional_config={"diffusion_policy": "es", **engine}):
                pass
    with pytest.raises(Exception, match=r"at least 4 needed, or set 'skip_layers'"):
        with diffusion_llm(dense_checkpoint, diffusion_block_size=8,
                           additional_config={"diffusion_policy": "es"}):
            pass
    with diffusion_llm(dense_checkpoint, diffusion_block_size=8,
                       additional_config={"diffusion_policy": "ada"}) as llm:
        for extra, message in (({"capacity": 0.0}, r"'capacity' must be float in \(0.0, 1.0\]"),
                               ({"history": 0}, r"'history' must be int in \[1, 16\]"),
                               ({"static_threshold": 1.5},
                                r"'static_threshold' must be float in \[0.0, 1.0\] or null"),
                               ({"strategy": "sequential"}, r"unknown option.*'strategy'")):
            with pytest.raises(rejected, match=message):
                llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]),
                             SamplingParams(max_tokens=4, extra_args=extra), use_tqdm=False)


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


@pytest.mark.parametrize("policy", ["es", "ada"])
def test_abort_mid_block_leaves_no_policy_state(four_layer_checkpoint, policy):
    with diffusion_llm(four_layer_checkpoint, diffusion_block_size=16,
                       additional_config={"diffusion_policy": policy}) as llm:
        engine, runner = llm.llm_engine, runner_of(llm)
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                extra_args={"threshold": 0.99} if policy == "es" else None)
        engine.add_request("aborted", TokensPrompt(prompt_token_ids=list(range(5, 14))), params)
        for _ in range(3):
            engine.step()
        (request,) = runner.diffusion_requests.values()  # its id carries an engine suffix
        assert request.canvas.steps >= 2  # mid-block
        assert runner.block_slots.in_use == 1
        held = weakref.ref(request.policy_state)
        internal_id = request.req_id
        del request
        engine.abort_request(["aborted"])
        out = llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]),
                           SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        assert internal_id not in runner.diffusion_requests
        # the aborted request's slot was given back (the later request's is held until
        # the engine hears that it finished)
        assert runner.block_slots.in_use == len(runner.diffusion_requests) <= 1
        gc.collect()
        assert held() is None


@pytest.mark.parametrize("policy", ["es", "ada"])
def test_preemption_decodes_completely_and_leaves_no_state(four_layer_checkpoint, policy):
    block_size, page_size = 8, 16
    mask_id, stops, vocab_size = checkpoint_info(four_layer_checkpoint)
    rng = random.Random(11)
    allowed = [t for t in range(vocab_size) if t not in stops | {mask_id}]
    prompts = [[rng.choice(allowed) for _ in range(rng.randint(5, 30))] for _ in range(8)]
    with diffusion_llm(four_layer_checkpoint, diffusion_block_size=block_size,
                       block_size=page_size, num_gpu_blocks_override=12,
                       enable_prefix_caching=False, max_model_len=128,
                       additional_config={"diffusion_policy": policy}) as llm:
        preempted = watch_preemptions(llm)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                               SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                               use_tqdm=False)
        runner = runner_of(llm)
        llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]),
                     SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        assert set(runner.diffusion_requests) <= set(runner.requests)  # finished ones dropped
    assert preempted, "no request was preempted; the test does not cover preemption"
    for out in outputs:
        tokens = list(out.outputs[0].token_ids)
        assert len(tokens) == 40 and mask_id not in tokens


def test_ada_without_its_cache_decodes_the_same_under_preemption(four_layer_checkpoint):
    """Without the intra-block cache Ada-DLM's block KV is a function of its canvas, and its
    confidence history survives a preemption, so a preempted request decodes exactly as
    in an engine with room for every request."""
    mask_id, stops, vocab_size = checkpoint_info(four_layer_checkpoint)
    rng = random.Random(12)
    allowed = [t for t in range(vocab_size) if t not in stops | {mask_id}]
    prompts = [TokensPrompt(prompt_token_ids=[rng.choice(allowed)
                                              for _ in range(rng.randint(5, 30))])
               for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                            extra_args={"intra_block_cache": False})
    outputs, _ = outputs_with_and_without_room(
        four_layer_checkpoint, prompts, params, additional_config={"diffusion_policy": "ada"})
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize("policy", ["es", "ada"])
def test_a_resumed_block_keeps_the_decision_state(policy):
    """A resumed block (``plan_step(request, "resumed")``) keeps the confidence cache / history (and ES-dLLM's
    decoded positions) in the request's slot rows, and asks for a step that recomputes the
    block; a new block resets them."""
    from vllm_diffusion.policies import POLICIES
    from vllm_diffusion.step.request import DiffusionRequest
    from vllm_diffusion.step.slots import BlockSlots

    cls = POLICIES[policy]
    config = cls.config_cls()
    policy_object = cls(8, 0, config)
    slots = BlockSlots(8, 2)
    slots.acquire()  # another request's
    request = DiffusionRequest("r", config, policy_object.new_state(config), False,
                               block_slots=slots, slot=slots.acquire())
    slot = request.slot
    request.block_for(0, [], 8, 0)
    policy_object.plan_step(request, "new")
    state = request.policy_state
    if policy == "es":
        tables = policy_object.slot_state
        tables.confidence.data[slot] = torch.linspace(0, 1, 8)
        tables.decoded_last_step.data[slot, 2] = True
        state.kv_lost = False
        policy_object.plan_step(request, "resumed")
        assert torch.equal(tables.confidence.data[slot], torch.linspace(0, 1, 8))
        assert bool(tables.decoded_last_step.data[slot, 2]) and state.kv_lost
        policy_object.plan_step(request, "new")
        assert not bool(tables.confidence.data[slot].any())
    else:
        history = policy_object.history_table(config.history)
        history.data[slot] = 1.0
        state.cache.uncached[:4] = False
        policy_object.plan_step(request, "resumed")
        assert torch.equal(history.data[slot], torch.ones(8, 3))
        assert bool(state.cache.processing_set().all())  # the block is recomputed
        policy_object.plan_step(request, "new")
        assert not bool(history.data[slot].any())


def test_es_caches_are_rows_of_the_policys_slot_table():
    """The skip layers' cached outputs live in one [S, B, d] table of the policy, written
    in place at each request's slot; a request out of a step keeps its rows, and a request
    that takes a slot given back starts its block with zero caches."""
    from vllm_diffusion.policies.es import EsPolicy
    from vllm_diffusion.step.hooks import ForwardStep, LayerInput, StepRequest
    from vllm_diffusion.step.request import DiffusionRequest
    from vllm_diffusion.step.slots import BlockSlots

    block, width = 4, 6
    policy = EsPolicy(block, 0, EsPolicy.config_cls())
    policy.skip_layers = (2,)
    slots = BlockSlots(block, 2)

    def new_request(name):
        config = EsPolicy.config_cls()
        request = DiffusionRequest(name, config, policy.new_state(config), False,
                                   block_slots=slots, slot=slots.acquire())
        request.block_for(0, [], block, 0)
        policy.plan_step(request, "new")
        return request

    def hooks_of(members):
        parts = [StepRequest(r, range(i * block, (i + 1) * block),
                             torch.arange(i * block, (i + 1) * block), torch.arange(block))
                 for i, r in enumerate(members)]
        return policy.forward_hooks(ForwardStep(parts, block * len(members),
                                                torch.device("cpu")))

    def step(members):
        rows = torch.arange(block * len(members))
        hidden = torch.randn(len(rows), width)
        hooks_of(members).after_output(LayerInput(2, rows, hidden=hidden))
        return hidden

    a, b = new_request("a"), new_request("b")
    first = step([a, b])
    table = policy.slot_state.outputs[2].data  # [S, B, d]
    assert table.shape == (2, block, width)
    assert torch.equal(table[a.slot], first[:block]) and torch.equal(table[b.slot], first[block:])
    later = step([b])  # "a" is not in this step: its rows stay
    assert policy.slot_state.outputs[2].data is table  # updated in place
    assert torch.equal(table[a.slot], first[:block]) and torch.equal(table[b.slot], later)
    slots.release(a.slot)  # "a" ends; "c" takes its slot
    c = new_request("c")
    assert c.slot == a.slot
    hooks_of([c, b])
    assert not bool(table[c.slot].any()) and torch.equal(table[b.slot], later)
