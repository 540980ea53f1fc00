"""Shared fixtures: tiny seeded SDAR checkpoints and in-process vLLM engines on CPU."""

from __future__ import annotations

import contextlib
import gc
import os
import pathlib

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from vllm_diffusion.testing.tiny_sdar import build_tiny_sdar  # noqa: E402


@pytest.fixture(scope="session")
def dense_checkpoint(tmp_path_factory) -> pathlib.Path:
    return build_tiny_sdar(tmp_path_factory.mktemp("sdar-dense"), block_size=4)


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory) -> pathlib.Path:
    return build_tiny_sdar(tmp_path_factory.mktemp("sdar-moe"), moe=True, block_size=4)


@contextlib.contextmanager
def diffusion_llm(checkpoint: pathlib.Path, *, diffusion_block_size: int | None = None,
                  max_model_len: int = 512, max_num_seqs: int = 8, **kwargs):
    """An in-process ``vllm.LLM`` on the CPU, torn down on exit."""
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory

    additional_config = dict(kwargs.pop("additional_config", {}))
    if diffusion_block_size is not None:
        additional_config["diffusion_block_size"] = diffusion_block_size
    llm = LLM(model=str(checkpoint), dtype="float32", enforce_eager=True, seed=0,
              max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              additional_config=additional_config, **kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
