"""Shared fixtures: tiny seeded SDAR checkpoints and in-process vLLM engines on CPU."""

from __future__ import annotations

import os
import pathlib

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from vllm_diffusion_lab.fixtures.tiny_sdar import build_tiny_sdar  # noqa: E402
from vllm_diffusion_lab.offline import diffusion_llm  # noqa: E402,F401


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
