"""An in-process ``vllm.LLM`` for a block-diffusion checkpoint (``diffusion_llm``) or for
stock autoregressive decoding (``autoregressive_llm``), torn down on exit.

Used by the quality harness, the benchmarks and the tests; several can be opened one
after the other in one process.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pathlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def diffusion_llm(model: str | pathlib.Path, *, diffusion_block_size: int | None = None,
                  max_model_len: int = 512, max_num_seqs: int = 8, **kwargs: Any) -> Iterator[Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    additional_config = dict(kwargs.pop("additional_config", {}))
    if diffusion_block_size is not None:
        additional_config["diffusion_block_size"] = diffusion_block_size
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("enforce_eager", True)  # the tests' and benchmarks' default
    llm = LLM(model=str(model), seed=0, max_model_len=max_model_len,
              max_num_seqs=max_num_seqs, additional_config=additional_config, **kwargs)
    try:
        yield llm
    finally:
        shut_down(llm)


@contextlib.contextmanager
def autoregressive_llm(model: str | pathlib.Path, *, max_model_len: int = 1024,
                       max_num_seqs: int = 8, **kwargs: Any) -> Iterator[Any]:
    """Stock vLLM at its defaults (compiled unless ``enforce_eager``) for ``model``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    kwargs.setdefault("dtype", "float32")
    llm = LLM(model=str(model), seed=0, max_model_len=max_model_len,
              max_num_seqs=max_num_seqs, **kwargs)
    try:
        yield llm
    finally:
        shut_down(llm)


def shut_down(llm: Any) -> None:
    """Stop an in-process engine and free what it held, so that another can start."""
    from vllm.distributed import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def counter_delta(before: Any, after: Any) -> Any:
    """``after - before`` of one counter (per-layer lists element-wise, a list growing from
    empty at the first step; dicts of counters key by key); a reading that is not a count
    (a float such as a model's error, or None) is the latest one."""
    if isinstance(after, list):
        return [a - (before[i] if i < len(before) else 0) for i, a in enumerate(after)]
    if isinstance(after, dict):
        return {k: counter_delta((before or {}).get(k, 0), v) for k, v in after.items()}
    if isinstance(after, int) and isinstance(before, int):
        return after - before
    return after


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Counters between two ``diffusion_stats`` readings, with the derived ratios."""
    stats: dict[str, Any] = {k: counter_delta(before[k], after[k]) for k in after}
    stats["denoising_steps_per_block"] = stats["denoising_steps"] / max(stats["blocks_completed"], 1)
    stats["tokens_committed_per_denoising_step"] = (
        stats["tokens_committed"] / max(stats["denoising_steps"], 1))
    committed = max(stats["tokens_committed"], 1)
    stats["block_positions_per_committed_token"] = stats["block_positions_computed"] / committed
    # The same through the layers after a policy's eviction point (layers 2+ for FOCUS).
    stats["later_layer_positions_per_committed_token"] = (
        stats["block_positions_after_eviction"] / committed)
    # Block positions through each layer, per committed token.
    stats["layer_positions_per_committed_token"] = [
        count / committed for count in stats["block_positions_per_layer"]]
    # Every row the model computed (prompt prefill and block commits included).
    stats["all_positions_per_committed_token"] = stats["positions_computed"] / committed
    return stats
