"""Where the conversion's training data lives, and which prompts it must never hold."""

from __future__ import annotations

import pathlib

from vllm_diffusion_lab.real_model.original import cache_dir


def distilled_path() -> pathlib.Path:
    return cache_dir() / "smollm2-distilled.jsonl"


def excluded_prompts() -> list[str]:
    """Every evaluation and benchmark prompt (kept out of training data: the distillation
    skips them and the training loader drops any example that holds one)."""
    from vllm_diffusion_lab.quality.chat_set import OTHER_KIND_PROMPTS
    from vllm_diffusion_lab.real_model.evaluation_set import evaluation_prompts
    return list(OTHER_KIND_PROMPTS) + evaluation_prompts()
