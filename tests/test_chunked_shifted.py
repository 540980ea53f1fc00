"""Chunked decoding on a model whose logits are shifted (Fast-dLLM v2's form, the default
model's): greedy output of ``standard`` with ``chunk_size`` (with and without
``chunk_reuse``) and of ``elastic`` with a pinned chunk equal to the plain-PyTorch
reference (``reference_chunked_shifted``, importing no package code) token for token on a
named grid -- chunks 2 and 4, blocks 8 and 16, prompts shorter than a block, of exactly
one block and ending inside the second -- alone and in one batch."""

from __future__ import annotations

import json
import pathlib

import pytest

from conftest import diffusion_llm
from reference_chunked_shifted import reference_chunked_shifted_generate
from reference_fast_dllm_v2 import ReferenceFastDLLMv2
from test_focus_shifted import assert_alone_and_batched

from vllm_diffusion_lab.fixtures.tiny_fast_dllm_v2 import build_tiny_fast_dllm_v2

pytestmark = pytest.mark.engine

MAX_TOKENS = 24
PROMPTS = {"short": [11, 12, 13, 14, 15], "one-block": list(range(40, 56)),
           "tail": list(range(60, 81))}
# (chunk, reuse)
CASES = {"chunk2": (2, False), "chunk4": (4, False), "chunk2-reuse": (2, True),
         "chunk4-reuse": (4, True)}
STRATEGY = {"strategy": "threshold", "threshold": 0.3}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> pathlib.Path:
    return build_tiny_fast_dllm_v2(tmp_path_factory.mktemp("fast-dllm-v2-chunked"),
                                   bd_size=16, num_layers=3, seed=5)


@pytest.mark.parametrize("policy", ["standard", "elastic"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_chunks_equal_the_shifted_chunked_reference(checkpoint, block_size, policy):
    from vllm import SamplingParams

    mask_id = json.loads((checkpoint / "config.json").read_text())["mask_token_id"]
    reference = ReferenceFastDLLMv2(checkpoint)
    cases = [(case, name) for case in CASES for name in PROMPTS
             if policy == "standard" or CASES[case][1]]  # elastic reuses (its default)
    want = {(case, name): reference_chunked_shifted_generate(
        reference, PROMPTS[name], block_size=block_size, mask_id=mask_id,
        max_tokens=MAX_TOKENS, chunk=CASES[case][0], reuse=CASES[case][1], **STRATEGY)
        for case, name in cases}
    assert len({tuple(v) for v in want.values()}) > len(PROMPTS)  # the cases differ

    def params(case):
        chunk, reuse = CASES[case]
        options = {**STRATEGY, "chunk_size": chunk, "sub_block_size": block_size}
        if policy == "standard":
            options["chunk_reuse"] = reuse
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                              extra_args=options)

    with diffusion_llm(checkpoint, diffusion_block_size=block_size, max_num_seqs=16,
                       additional_config={"diffusion_policy": policy}) as llm:
        assert_alone_and_batched(llm, PROMPTS, cases, params, want)
