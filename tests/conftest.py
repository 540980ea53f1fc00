"""Shared fixtures: tiny seeded SDAR checkpoints and in-process vLLM engines on CPU."""

from __future__ import annotations

import os
import pathlib

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (the README's test command runs a worker per core), each worker's
# engines compute on a core of their own: vLLM's automatic binding puts every engine's
# threads on the first core (it reserves the last one for its scheduler).
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw") and (os.cpu_count() or 1) > 1:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(
        int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw")) % os.cpu_count()))

import pytest  # noqa: E402

from vllm_diffusion_lab.fixtures.tiny_sdar import build_tiny_sdar  # noqa: E402
from vllm_diffusion_lab.offline import diffusion_llm  # noqa: E402,F401


@pytest.fixture
def two_cpu_ranks(monkeypatch):
    """Tensor parallelism of 2 on CPU: skipped below two cores; each rank's threads bound
    to one core (vllm-cpu binds them to a NUMA node unless told which cores to use). An
    engine started earlier in this process froze vLLM's environment reads
    (``enable_envs_cache``), so the cache is dropped for the new value to be read."""
    import vllm.envs

    if (os.cpu_count() or 1) < 2:
        pytest.skip("tensor parallelism on CPU needs two cores")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    vllm.envs.disable_envs_cache()


@pytest.fixture
def sparse_calls(monkeypatch):
    """Layers attended with a key selection, in this process's engines: (requests on the
    sparse path, requests selecting) per layer call."""
    from vllm_diffusion.attention import backend

    calls = []
    original = backend.attend_with_key_selection

    def spy(query, kv_cache, rows, block_table, block_size, selection, *args, **kwargs):
        calls.append((len(selection.sparse), len(selection.scoring)))
        return original(query, kv_cache, rows, block_table, block_size, selection, *args,
                        **kwargs)

    monkeypatch.setattr(backend, "attend_with_key_selection", spy)
    return calls


@pytest.fixture(scope="session")
def dense_checkpoint(tmp_path_factory) -> pathlib.Path:
    return build_tiny_sdar(tmp_path_factory.mktemp("sdar-dense"), block_size=4)


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory) -> pathlib.Path:
    return build_tiny_sdar(tmp_path_factory.mktemp("sdar-moe"), moe=True, block_size=4)


def watch_preemptions(llm) -> list[str]:
    """Ids of requests the in-process engine's scheduler preempts from now on."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    preempted: list[str] = []
    preempt = scheduler._preempt_request

    def counting_preempt(request, *args, **kwargs):
        preempted.append(request.request_id)
        return preempt(request, *args, **kwargs)

    scheduler._preempt_request = counting_preempt
    return preempted


def assert_abort_mid_block_frees_kv(llm, params) -> None:
    """A request (``params``, sequential unmasking) aborted once its block is part
    decoded leaves no KV block held. Steps until the request holds KV first (a grammar
    is compiled before the request is scheduled)."""
    import time

    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    block_pool = engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    free_before = block_pool.get_num_free_blocks()
    engine.add_request("aborted", TokensPrompt(prompt_token_ids=list(range(5, 14))), params)
    for _ in range(200):
        engine.step()
        if block_pool.get_num_free_blocks() < free_before:
            break
        time.sleep(0.01)
    engine.step()  # sequential: one position per step, so the block is part decoded
    assert block_pool.get_num_free_blocks() < free_before
    engine.abort_request(["aborted"])
    while engine.has_unfinished_requests():
        engine.step()
    assert block_pool.get_num_free_blocks() == free_before


def token_prompts(prompts):
    """Token-id prompts as vLLM's ``TokensPrompt``s."""
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=p) for p in prompts]


def assert_batched_and_alone(llm, prompts: dict, params, want: dict, alone: str,
                             label=None) -> None:
    """Every prompt of ``prompts`` (name -> token ids) decoded batched, then ``alone`` by
    itself, gives ``want[name]`` token for token."""
    batch = llm.generate(token_prompts(prompts.values()), params, use_tqdm=False)
    for name, output in zip(prompts, batch):
        assert list(output.outputs[0].token_ids) == want[name], (label, name)
    single = llm.generate(token_prompts([prompts[alone]]), params, use_tqdm=False)
    assert list(single[0].outputs[0].token_ids) == want[alone], (label, alone)


def assert_dual_cache_preemptions_refresh(checkpoint, prompts: list[list[int]],
                                          engine: dict | None = None,
                                          options: dict | None = None,
                                          abort_options: dict | None = None,
                                          mask_id: int | None = None) -> None:
    """An engine short of pages under Fast-dLLM's ``dual`` cache (blocks of 4, a canvas of
    8, ``engine`` more options) preempts some of ``prompts`` (4 of them, request options
    ``options``) mid-block; each resumes with a refresh and finishes its 20 tokens (5
    blocks: more refreshes than blocks; none the mask token ``mask_id`` where given); a
    request aborted mid-block (``abort_options``, default sequential) gives its pages
    back."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_diffusion_lab.offline import stats_delta

    def greedy(max_tokens: int, extra: dict | None) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                              extra_args=extra or None)

    with diffusion_llm(checkpoint, diffusion_block_size=4, block_size=16,
                       max_model_len=48, max_num_seqs=4, num_gpu_blocks_override=5,
                       additional_config={**(engine or {}), "diffusion_canvas_tokens": 8,
                                          "diffusion_cache_mode": "dual"}) as llm:
        watched = watch_preemptions(llm)
        before = llm.collective_rpc("diffusion_stats")[0]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                               greedy(20, options), use_tqdm=False)
        stats = stats_delta(before, llm.collective_rpc("diffusion_stats")[0])
        assert watched, "no request was preempted; the test does not cover preemption"
        for output in outputs:
            tokens = list(output.outputs[0].token_ids)
            assert len(tokens) == 20 and mask_id not in tokens
        assert stats["kv_refreshes"] > 5 * len(prompts), stats  # 5 blocks each, and resumes
        assert_abort_mid_block_frees_kv(
            llm, greedy(16, abort_options or {"strategy": "sequential"}))


def outputs_with_and_without_room(checkpoint, prompts, params, **engine) -> tuple[dict, list]:
    """Greedy outputs ({tight: [token ids]}) of an engine with room for every request
    and of one so short of KV pages that requests are preempted, and the preempted ids."""
    outputs, preempted = {}, []
    for tight in (False, True):
        room = {"num_gpu_blocks_override": 12} if tight else {}
        with diffusion_llm(checkpoint, diffusion_block_size=8, block_size=16,
                           enable_prefix_caching=False, max_model_len=128, **room,
                           **engine) as llm:
            watched = watch_preemptions(llm)
            outputs[tight] = [list(o.outputs[0].token_ids)
                              for o in llm.generate(prompts, params, use_tqdm=False)]
            if tight:
                preempted = watched
    assert preempted, "no request was preempted; the test does not cover preemption"
    return outputs, preempted
