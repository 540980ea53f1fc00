"""Start-up warm-up of the diffusion steps: a few dummy requests are decoded before the
engine reports ready, so that the pieces a policy with hooks between layers compiles
lazily are compiled. See docs/architecture.md, "Warm-up".
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
# Requests decoded together: two (the pieces' row dimension traced as dynamic), then one.
WARM_UP_BATCHES = (2, 1)
WARM_UP_OUTPUT_BLOCKS = 3  # output blocks per request: the first, later ones, the end


def needs_warm_up(runner: Any) -> bool:
    vllm_config, events = runner.vllm_config, runner.vllm_config.kv_events_config
    if (vllm_config.model_config.enforce_eager or vllm_config.kv_transfer_config is not None
            or (events is not None and events.enable_kv_cache_events)):
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

    block = runner.diffusion.block_size
    token = 1 if runner.diffusion.mask_token_id == 0 else 0  # any token but the mask
    params = SamplingParams(temperature=0.0, ignore_eos=True,
                            max_tokens=WARM_UP_OUTPUT_BLOCKS * block)
    return [Request(f"{WARM_UP_REQUEST_PREFIX}{number}-{i}", [token] * (block + 1 + i),
                    params, None, block_hasher=hasher) for i in range(batch)]


def warm_up_steps(runner: Any) -> None:
    """Decode the warm-up requests through ``runner`` (its KV cache allocated, before any
    request arrives); a no-op where ``needs_warm_up`` is false."""
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
        for name, value in vars(saved_stats).items():
            setattr(runner.diffusion_stats, name, value)
    logger.info("vllm-diffusion: warmed up the %s policy's steps in %.1f s (%d steps of "
                "dummy requests, batches of %s)", runner.diffusion.policy_name,
                time.perf_counter() - started, steps,
                " and ".join(map(str, WARM_UP_BATCHES)))
