"""Sparse-dLLM (``sparse_prefix``) on a model whose logits are shifted (Fast-dLLM v2's form,
the default model's): greedy output equal to the plain-PyTorch reference
(``reference_sparse_shifted``, importing no package code) token for token on a named grid
-- the paper's retention and delay, a tighter retention selecting at the block's first
step, one list per KV head -- block sizes 8 and 16, prompts shorter than a block, of
exactly one block (the first token by the autoregressive step) and over two blocks ending
inside the third, alone and in one batch."""

from __future__ import annotations

import json
import pathlib

import pytest

from conftest import diffusion_llm
from reference_fast_dllm_v2 import ReferenceFastDLLMv2
from reference_sparse_shifted import reference_sparse_shifted_generate
from test_focus_shifted import assert_alone_and_batched

from vllm_diffusion_lab.fixtures.tiny_fast_dllm_v2 import build_tiny_fast_dllm_v2

pytestmark = pytest.mark.engine

MAX_TOKENS = 24
PROMPTS = {"short": [11, 12, 13, 14, 15], "one-block": list(range(40, 56)),
           "tail": list(range(60, 95))}
# named option sets around the paper's defaults (retention 0.5, kernel 3, delay 1);
# threshold 0.5 on a random model: mostly one token a step; each request sets the
# sub-block to the whole block (the family's default sub-blocks of 8 would confine
# commits to one; the reference decodes whole blocks)
CASES = {"paper": {}, "tight-first-step": {"retention_ratio": 0.2, "delay_steps": 0},
         "per-kv-head": {"retention_ratio": 0.3, "per_kv_head": True, "pool_kernel": 1}}
DEFAULTS = {"strategy": "threshold", "threshold": 0.5, "retention_ratio": 0.5,
            "pool_kernel": 3, "delay_steps": 1, "per_kv_head": False}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> pathlib.Path:
    return build_tiny_fast_dllm_v2(tmp_path_factory.mktemp("fast-dllm-v2-sparse"),
                                   bd_size=16, num_layers=4, seed=7)


@pytest.mark.parametrize("block_size", [8, 16])
def test_sparse_prefix_equals_the_shifted_reference(checkpoint, block_size):
    from vllm import SamplingParams

    mask_id = json.loads((checkpoint / "config.json").read_text())["mask_token_id"]
    reference = ReferenceFastDLLMv2(checkpoint)
    cases = [(case, name) for case in CASES for name in PROMPTS]
    want = {(case, name): reference_sparse_shifted_generate(
        reference, PROMPTS[name], block_size=block_size, mask_id=mask_id,
        max_tokens=MAX_TOKENS, **{**DEFAULTS, **CASES[case]}) for case, name in cases}
    dense = {name: reference_sparse_shifted_generate(
        reference, PROMPTS[name], block_size=block_size, mask_id=mask_id,
        max_tokens=MAX_TOKENS, **{**DEFAULTS, "retention_ratio": 1.0}) for name in PROMPTS}
    # the selections change the output somewhere (the grid is not the dense decoding)
    assert any(want[case, name] != dense[name] for case, name in cases)

    def params(case):
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                              extra_args={**DEFAULTS, **CASES[case],
                                          "sub_block_size": block_size})

    with diffusion_llm(checkpoint, diffusion_block_size=block_size, max_num_seqs=16,
                       additional_config={"diffusion_policy": "sparse_prefix"}) as llm:
        assert_alone_and_batched(llm, PROMPTS, cases, params, want)
