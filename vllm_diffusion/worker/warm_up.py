"""Start-up warm-up of the diffusion steps: what the first requests run is compiled before
the engine reports ready.

vLLM's start-up compiles the model's whole forward (on CPU ``CPUWorker``'s
``determine_available_memory`` runs ``CPUModelRunner.warming_up_model``, a profiling
forward of ``max_num_batched_tokens`` rows), which is what a step without hooks between
layers runs (the ``standard`` policy). A policy whose steps have hooks between layers
(FOCUS, ES-dLLM) runs the layers between its hook points as pieces that ``torch.compile``
compiles at their first call (``models/layer_segments.py``): that was the first request,
which waited for the compilation (on ``checkpoints/sdar-small-chat`` with FOCUS: 17 s on
an idle two-core machine, 104 s where it was first observed; the next request took
0.03 s).

``warm_up_steps`` decodes a few short dummy requests through the runner, batched and
alone, with a diffusion scheduler of its own over the worker's KV-cache layout, so that the
steps run the way real requests' steps do (prefill, the first and later blocks, the
policy's hooks and row drops) and the pieces are compiled before the worker reports
ready. A policy instance of its own serves them, and the runner's counters are put back
afterwards: what a client sees of the engine (counters, metrics, the policy's learned
state) starts from nothing as before. Skipped where nothing is compiled lazily: an eager
engine, or a policy that does not override ``forward_hooks`` (its steps run the model
vLLM warmed up); and where a scheduler of its own would touch more than the worker's KV
cache (a KV connector or KV events).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from vllm.logger import init_logger

from vllm_diffusion.policies.base import DecodingPolicy

logger = init_logger(__name__)

WARM_UP_REQUEST_PREFIX = "vllm-diffusion-warm-up-"
# Requests decoded together: two first (so that the pieces' row dimension is traced as
# dynamic, not specialised to one row), then one alone.
WARM_UP_BATCHES = (2, 1)
WARM_UP_OUTPUT_BLOCKS = 3  # output blocks per request: the first, later ones, the end


def needs_warm_up(runner: Any) -> bool:
    vllm_config = runner.vllm_config
    if vllm_config.model_config.enforce_eager:
        return False
    if vllm_config.kv_transfer_config is not None:
        return False
    events = vllm_config.kv_events_config
    if events is not None and events.enable_kv_cache_events:
        return False
    return type(runner.policy).forward_hooks is not DecodingPolicy.forward_hooks


def _scheduler(runner: Any):
    """A diffusion scheduler over the worker's KV-cache layout, with the engine core's
    block hashing where prefix caching is on."""
    from vllm.v1.core.kv_cache_utils import (get_request_block_hasher, init_none_hash,
                                             resolve_kv_cache_block_sizes)
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.utils.hashing import get_hash_fn_by_name

    from vllm_diffusion.worker.scheduler import BlockDiffusionScheduler

    vllm_config = runner.vllm_config
    kv_cache_config = copy.deepcopy(runner.kv_cache_config)
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    scheduler = BlockDiffusionScheduler(
        vllm_config=vllm_config, kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size, hash_block_size=hash_block_size, log_stats=False)
    hasher = None
    if vllm_config.cache_config.enable_prefix_caching:
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(hash_block_size, hash_fn)
    return scheduler, hasher


def _requests(runner: Any, batch: int, number: int, hasher) -> list[Any]:
    """``batch`` greedy requests of one block and a tail of prompt, decoding
    ``WARM_UP_OUTPUT_BLOCKS`` blocks to their end."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    diffusion = runner.diffusion
    block = diffusion.block_size
    token = 1 if diffusion.mask_token_id == 0 else 0  # any token but the mask
    params = SamplingParams(temperature=0.0, ignore_eos=True,
                            max_tokens=WARM_UP_OUTPUT_BLOCKS * block)
    return [Request(f"{WARM_UP_REQUEST_PREFIX}{number}-{i}", [token] * (block + 1 + i),
                    params, None, block_hasher=hasher) for i in range(batch)]


def _restore(stats: Any, saved: Any) -> None:
    for name, value in vars(saved).items():
        setattr(stats, name, value)


def warm_up_steps(runner: Any) -> None:
    """Decode the warm-up requests through ``runner`` (a ``DiffusionRunnerMixin`` whose KV
    cache is allocated, before any request arrives); a no-op where ``needs_warm_up`` is
    false."""
    if not needs_warm_up(runner):
        return
    started = time.perf_counter()
    scheduler, hasher = _scheduler(runner)
    policy, saved_stats = runner.policy, copy.deepcopy(runner.diffusion_stats)
    runner.policy = runner.diffusion.make_policy()
    runner.policy.bind(runner.diffusion.model, runner.vllm_config.model_config.hf_config,
                       bool(runner.cache_config.enable_prefix_caching))
    steps = 0
    try:
        # in the inference mode the worker's execute_model runs in (the compiled pieces
        # guard on the grad mode)
        with torch.inference_mode():
            for number, batch in enumerate(WARM_UP_BATCHES):
                for request in _requests(runner, batch, number, hasher):
                    scheduler.add_request(request)
                # until the requests are finished and the runner was told (the step after)
                while scheduler.has_requests():
                    output = scheduler.schedule()
                    scheduler.update_from_output(output, runner.execute_model(output))
                    steps += 1
    finally:
        runner.policy = policy
        _restore(runner.diffusion_stats, saved_stats)
    logger.info("vllm-diffusion: warmed up the %s policy's steps in %.1f s (%d steps of "
                "dummy requests, batches of %s)", runner.diffusion.policy_name,
                time.perf_counter() - started, steps,
                " and ".join(map(str, WARM_UP_BATCHES)))
