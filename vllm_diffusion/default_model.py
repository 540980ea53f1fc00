"""The embedded models: the default one used by the README's main job and the benchmarks,
and the tiny one the fast tests and the CI quality test use.

``vllm_diffusion/checkpoints/sdar-small-chat`` (12 layers) is the default;
``vllm_diffusion/checkpoints/sdar-tiny-chat`` (4 layers) is the tiny one. Without either
(a source tree stripped of its weights), a tiny seeded random SDAR checkpoint is built on
first use (deterministic, a few hundred kB) under ``$VLLM_DIFFUSION_CACHE`` (default
``~/.cache/vllm-diffusion``).
"""

from __future__ import annotations

import os
import pathlib

CHECKPOINTS = pathlib.Path(__file__).parent / "checkpoints"
DEFAULT_CHECKPOINT = CHECKPOINTS / "sdar-small-chat"
TINY_CHECKPOINT = CHECKPOINTS / "sdar-tiny-chat"


def default_model_path() -> pathlib.Path:
    for checkpoint in (DEFAULT_CHECKPOINT, TINY_CHECKPOINT):
        if (checkpoint / "model.safetensors").exists():
            return checkpoint
    from vllm_diffusion.testing.tiny_sdar import build_tiny_sdar

    cache = pathlib.Path(os.environ.get("VLLM_DIFFUSION_CACHE",
                                        pathlib.Path.home() / ".cache" / "vllm-diffusion"))
    path = cache / "tiny-sdar-random"
    if not (path / "model.safetensors").exists():
        build_tiny_sdar(path)
    return path
