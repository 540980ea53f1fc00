"""The embedded default model used by the README's main job and the benchmarks.

The project's trained checkpoint (``vllm_diffusion/checkpoints/sdar-tiny-chat``) when it is
present, else a tiny seeded random SDAR checkpoint built on first use (deterministic, a
few hundred kB) under ``$VLLM_DIFFUSION_CACHE`` (default ``~/.cache/vllm-diffusion``).
"""

from __future__ import annotations

import os
import pathlib

TRAINED_CHECKPOINT = pathlib.Path(__file__).parent / "checkpoints" / "sdar-tiny-chat"


def default_model_path() -> pathlib.Path:
    if (TRAINED_CHECKPOINT / "model.safetensors").exists():
        return TRAINED_CHECKPOINT
    from vllm_diffusion.testing.tiny_sdar import build_tiny_sdar

    cache = pathlib.Path(os.environ.get("VLLM_DIFFUSION_CACHE",
                                        pathlib.Path.home() / ".cache" / "vllm-diffusion"))
    path = cache / "tiny-sdar-random"
    if not (path / "model.safetensors").exists():
        build_tiny_sdar(path)
    return path
