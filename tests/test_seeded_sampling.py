"""Seeded sampled outputs are pinned: the token streams below were recorded with the
per-request sampling loop of commit 39a6c50, before proposals were batched over requests.
The batched path must draw exactly the same tokens (each request's generator is used in
the same order on identical filtered distributions), for both policies, with greedy and
differently filtered sampled requests sharing one batch."""

from __future__ import annotations

import json
import pathlib

import pytest
from conftest import diffusion_llm

from vllm import SamplingParams

from vllm_diffusion.default_model import TINY_CHECKPOINT
from vllm_diffusion_lab.quality.corpus import eval_examples
from vllm_diffusion_lab.quality.harness import chat_prompts

pytestmark = pytest.mark.engine
PINNED = json.loads((pathlib.Path(__file__).parent / "data" / "seeded_sampling.json").read_text())


@pytest.mark.parametrize("policy", ["standard", "focus"])
def test_seeded_sampled_outputs_are_unchanged(policy):
    params = [SamplingParams(temperature=0.7, seed=1, max_tokens=24),
              SamplingParams(temperature=1.0, top_k=20, seed=2, max_tokens=24),
              SamplingParams(temperature=0.9, top_p=0.85, seed=3, max_tokens=24),
              SamplingParams(temperature=0, max_tokens=24)]
    with diffusion_llm(str(TINY_CHECKPOINT), diffusion_block_size=4,
                       additional_config={"diffusion_policy": policy}) as llm:
        prompts = chat_prompts(llm.get_tokenizer(), eval_examples(1))[:4]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == PINNED[policy]
