"""Ada-DLM on a model whose logits are shifted (Fast-dLLM v2's form, the default model's):
greedy output equal to the plain-PyTorch reference (``reference_ada_shifted``, importing no
package code) token for token on a named grid -- the paper's capacity and history, a wider
capacity with one step of history, a confidence floor -- block sizes 8 and 16, prompts of
whole blocks (the first token by the autoregressive step) and ending inside a block, alone
and in one batch; its intra-block cache refused there."""

from __future__ import annotations

import json
import pathlib

import pytest

from conftest import diffusion_llm
from reference_ada_shifted import reference_ada_shifted_generate
from reference_fast_dllm_v2 import ReferenceFastDLLMv2
from test_focus_shifted import assert_alone_and_batched

from vllm_diffusion_lab.fixtures.tiny_fast_dllm_v2 import build_tiny_fast_dllm_v2

pytestmark = pytest.mark.engine

MAX_TOKENS = 24
PROMPTS = {"one-block": list(range(40, 56)), "tail": list(range(60, 81))}
# named option sets around the paper's defaults (capacity 0.15, history 3)
CASES = {"paper": {}, "wide": {"capacity": 0.5, "history": 1},
         "floor": {"capacity": 0.5, "confidence_floor": 0.02}}
DEFAULTS = {"capacity": 0.15, "history": 3}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> pathlib.Path:
    return build_tiny_fast_dllm_v2(tmp_path_factory.mktemp("fast-dllm-v2-ada"),
                                   bd_size=16, num_layers=4, seed=5)


@pytest.mark.parametrize("block_size", [8, 16])
def test_ada_equals_the_shifted_ada_reference(checkpoint, block_size):
    from vllm import SamplingParams

    mask_id = json.loads((checkpoint / "config.json").read_text())["mask_token_id"]
    reference = ReferenceFastDLLMv2(checkpoint)
    cases = [(case, name) for case in CASES for name in PROMPTS]
    want = {(case, name): reference_ada_shifted_generate(
        reference, PROMPTS[name], block_size=block_size, mask_id=mask_id,
        max_tokens=MAX_TOKENS, **{**DEFAULTS, **CASES[case]}) for case, name in cases}
    assert len({tuple(v) for v in want.values()}) > len(PROMPTS)  # the cases differ

    def params(case):
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                              extra_args=CASES[case] or None)

    with diffusion_llm(checkpoint, diffusion_block_size=block_size, max_num_seqs=16,
                       additional_config={"diffusion_policy": "ada"}) as llm:
        assert_alone_and_batched(llm, PROMPTS, cases, params, want)


def test_the_intra_block_cache_is_refused_where_logits_are_shifted(checkpoint):
    with pytest.raises(Exception, match="the ada policy cannot serve Fast-dLLM v2, whose "
                       "logits are shifted"):
        with diffusion_llm(checkpoint, diffusion_block_size=16,
                           additional_config={"diffusion_policy": "ada",
                                              "intra_block_cache": True}):
            pass
