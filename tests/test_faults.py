"""A bad request never takes the engine down: non-finite and malformed options are rejected
at admission, a failure in one request's policy work finishes only that request, and the
`LLM` serves the next call correctly after any exception. Includes a property-based test
that throws generated options and sampling values at a running FOCUS engine."""

from __future__ import annotations

import math

import pytest
from conftest import diffusion_llm
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt

from vllm_diffusion.worker import block_updates as block_updates_module
from vllm_diffusion.worker import step_plan as step_plan_module
from vllm_diffusion.worker.forward import ModelForward

pytestmark = pytest.mark.engine

REJECTED = (ValueError, TypeError, VLLMValidationError)
PROMPT = TokensPrompt(prompt_token_ids=[5, 6, 7, 8, 9, 10, 11])
BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def llm(dense_checkpoint):
    with diffusion_llm(dense_checkpoint, diffusion_block_size=BLOCK_SIZE, max_model_len=128,
                       additional_config={"diffusion_policy": "focus"}) as engine:
        yield engine


def reference_params(**extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, **extra)


@pytest.fixture(scope="module")
def reference_tokens(llm) -> list[int]:
    return list(llm.generate(PROMPT, reference_params(), use_tqdm=False)[0].outputs[0].token_ids)


def scheduler_of(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def assert_idle_and_correct(llm, reference_tokens) -> None:
    """Nothing held (requests, KV pages, diffusion state) and the reference request
    decodes exactly as before."""
    scheduler = scheduler_of(llm)
    assert not scheduler.requests and not scheduler.running and not len(scheduler.waiting)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # one null block
    out = llm.generate(PROMPT, reference_params(), use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == reference_tokens
    runner = runner_of(llm)
    llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert set(runner.diffusion_requests) <= set(runner.requests)  # finished requests dropped
    assert runner.block_slots.in_use == len(runner.diffusion_requests)  # their slots given back


NON_FINITE = [float("nan"), float("inf"), float("-inf"), "nan", "NaN", "inf", "-Infinity"]


@pytest.mark.parametrize("value", NON_FINITE, ids=repr)
@pytest.mark.parametrize("name", ["alpha", "threshold"])
def test_non_finite_options_are_rejected_naming_option_and_value(llm, reference_tokens,
                                                                 name, value):
    with pytest.raises(REJECTED, match=rf"option '{name}' must be a finite float.*got "):
        llm.generate([PROMPT, PROMPT], [reference_params(),
                                        reference_params(extra_args={name: value})],
                     use_tqdm=False)
    assert_idle_and_correct(llm, reference_tokens)


@pytest.mark.parametrize("extra_args, message", [
    ({"alpha": 10**400}, r"extra_args integers must be between"),  # vLLM's own check
    ({"alpha": [1.5]}, r"option 'alpha' must be float"),
    ({"alpha": {"value": 2}}, r"option 'alpha' must be float"),
    ({"pool_kernel": 2.5}, r"option 'pool_kernel' must be int"),
    ({"evict": "maybe"}, r"option 'evict' must be bool"),
    ({1: 2, "x": 3}, r"unknown option\(s\) 'x', 1; valid options"),
])
def test_malformed_options_are_rejected(llm, reference_tokens, extra_args, message):
    with pytest.raises(REJECTED, match=message):
        llm.generate(PROMPT, reference_params(extra_args=extra_args), use_tqdm=False)
    assert_idle_and_correct(llm, reference_tokens)


def test_seed_outside_the_generator_range_is_rejected(llm, reference_tokens):
    with pytest.raises(REJECTED, match=r"seed must be an integer in"):
        llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=2**70, max_tokens=4),
                     use_tqdm=False)
    assert_idle_and_correct(llm, reference_tokens)


def test_step_map_with_several_choices_is_rejected(llm):
    with pytest.raises(REJECTED, match=r"return_step_map requires n=1 \(got n=2\)"):
        llm.generate(PROMPT, SamplingParams(n=2, temperature=1.0, max_tokens=4,
                                            extra_args={"return_step_map": True}),
                     use_tqdm=False)


def test_llm_serves_the_next_call_after_an_exception_in_the_step(llm, reference_tokens,
                                                                 monkeypatch):
    forward = ModelForward.run
    calls = {"n": 0}

    def failing_forward(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # mid-block, after the first requests advanced
            raise RuntimeError("injected forward failure")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(ModelForward, "run", failing_forward)
    with pytest.raises(RuntimeError, match="injected forward failure"):
        llm.generate([PROMPT] * 3, reference_params(), use_tqdm=False)
    monkeypatch.setattr(ModelForward, "run", forward)
    assert_idle_and_correct(llm, reference_tokens)


@pytest.mark.parametrize("where", ["planning", "unmasking"])
def test_policy_failure_finishes_only_that_request(llm, reference_tokens, monkeypatch, where):
    """A host-side policy failure for one request: it finishes with an error, its KV and
    diffusion state are freed, the requests batched with it decode exactly as alone."""
    marker = 13  # max_tokens of the request whose policy work raises
    if where == "planning":
        plan = step_plan_module.plan_request

        def failing(req_id, token_ids, num_computed, *args, **kwargs):
            if num_computed > 0 and marked[req_id]:
                raise RuntimeError("injected planning failure")
            return plan(req_id, token_ids, num_computed, *args, **kwargs)

        monkeypatch.setattr(step_plan_module, "plan_request", failing)
    else:
        truncate = block_updates_module.truncate_at_stop

        def failing(tokens, params, num_output):
            if params.max_tokens == marker and num_output > 0:
                raise RuntimeError("injected unmasking failure")
            return truncate(tokens, params, num_output)

        monkeypatch.setattr(block_updates_module, "truncate_at_stop", failing)
    runner = runner_of(llm)
    marked = _MarkedRequests(runner, marker)
    params = [reference_params(), SamplingParams(temperature=0, max_tokens=marker,
                                                 ignore_eos=True), reference_params()]
    outputs = llm.generate([PROMPT] * 3, params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "error", "length"]
    for i in (0, 2):
        assert list(outputs[i].outputs[0].token_ids) == reference_tokens
    monkeypatch.undo()
    assert_idle_and_correct(llm, reference_tokens)


class _MarkedRequests:
    """req_id -> whether that request's max_tokens is the marker (read from the runner)."""

    def __init__(self, runner, marker: int) -> None:
        self.runner, self.marker = runner, marker

    def __getitem__(self, req_id: str) -> bool:
        return self.runner.requests[req_id].sampling_params.max_tokens == self.marker


# ------------------------------------------------------------- property-based
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.0, -1.0, 1.0, 1.5, 1e308, -1e308, 5e-324]))
# Values an option may validly take, drawn as often as the bad ones, so that many
# generated requests get through admission and run next to the reference request.
PLAUSIBLE = st.sampled_from([0.0, 0.5, 0.9, 1.0, 1.5, 2.0, 64.0, 1, 3, 5, True, False,
                             "threshold", "sequential", "exact"])
VALUES = st.one_of(
    PLAUSIBLE, PLAUSIBLE, PLAUSIBLE, FLOATS, st.integers(min_value=-(2**80), max_value=2**80), st.none(),
    st.sampled_from(["nan", "inf", "1.5", "", "delayed", "true"]),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(),
                                                         max_size=2))
OPTION_NAMES = st.sampled_from(["alpha", "threshold", "pool_kernel", "evict", "strategy",
                                "intra_block_cache", "commit", "denoising_steps",
                                "return_step_map", "diffusion_policy", "unknown_option"])
EXTRA_ARGS = st.dictionaries(OPTION_NAMES, VALUES, max_size=2)
VALID_UNIT = st.sampled_from([0.0, 0.3, 0.9, 1.0, 1.7])
UNIT = st.one_of(VALID_UNIT, VALID_UNIT, VALID_UNIT, FLOATS)
SAMPLING = st.fixed_dictionaries({}, optional={
    "temperature": UNIT, "top_p": UNIT, "top_k": st.integers(-5, 10**6),
    "seed": st.one_of(st.integers(0, 100), st.integers(-(2**70), 2**70)),
    "max_tokens": st.integers(-3, 40), "n": st.integers(1, 2)})


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(extra_args=EXTRA_ARGS, sampling=SAMPLING)
def test_generated_bad_input_never_breaks_the_engine(llm, reference_tokens, extra_args,
                                                     sampling):
    try:
        params = SamplingParams(**sampling, extra_args=extra_args)
    except REJECTED:
        event("refused by SamplingParams")
        return  # vLLM's own constructor refused it: nothing reached the engine
    try:
        outputs = llm.generate([PROMPT, PROMPT], [reference_params(), params], use_tqdm=False)
    except REJECTED:
        event("refused at admission")  # with a clear error
    else:
        event("served")
        assert list(outputs[0].outputs[0].token_ids) == reference_tokens
        assert outputs[1].outputs[0].finish_reason in ("length", "stop")
        for choice in outputs[1].outputs:
            assert all(math.isfinite(t) for t in choice.token_ids)
    assert_idle_and_correct(llm, reference_tokens)


def test_tiny_top_p_keeps_the_most_likely_token(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=1.0, top_p=6.9e-193, seed=0,
                                              max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    # Only the top token survives, as with top_k=1 (same tokens, confidence 1 everywhere).
    top_1 = llm.generate(PROMPT, SamplingParams(temperature=1.0, top_k=1, seed=0,
                                                max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length"
    assert list(out.token_ids) == list(top_1.token_ids)
