"""ES-dLLM on a model whose logits are shifted (Fast-dLLM v2's form, the default model's):
greedy output equal to the plain-PyTorch reference (``reference_es_shifted``, importing no
package code) token for token on a named grid -- the authors' bonuses and keep floor, then
without them, confidence alone, no block refresh -- block sizes 8 and 16, prompts of whole
blocks (the first token by the autoregressive step) and ending inside a block, alone and
in one batch; skipping computing fewer later-layer rows."""

from __future__ import annotations

import json
import pathlib

import pytest

from conftest import diffusion_llm
from reference_es_shifted import reference_es_shifted_generate
from reference_fast_dllm_v2 import ReferenceFastDLLMv2
from test_focus_shifted import assert_equal_alone_and_batched

from vllm_diffusion_lab.fixtures.tiny_fast_dllm_v2 import build_tiny_fast_dllm_v2

pytestmark = pytest.mark.engine

MAX_TOKENS = 24
SKIP_LAYERS = (2, 3)
PROMPTS = {"one-block": list(range(40, 56)), "tail": list(range(60, 81))}
# named option sets around the defaults (alpha 0.5, skip ratio 0.5, refresh every 4 steps)
CASES = {"authors": {}, "no-safeguards": {"priority_bonuses": False, "keep_floor": False},
         "confidence-only": {"alpha": 1.0}, "no-refresh": {"refresh_period": None}}
OPTIONS = {"strategy": "low_confidence_static", "threshold": 0.9}  # one token a step
DEFAULTS = {"alpha": 0.5, "skip_ratio": 0.5, "refresh_period": 4, "keep_floor": True,
            "priority_bonuses": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> pathlib.Path:
    return build_tiny_fast_dllm_v2(tmp_path_factory.mktemp("fast-dllm-v2-es"),
                                   bd_size=16, num_layers=6, seed=3)


@pytest.mark.parametrize("block_size", [8, 16])
def test_es_equals_the_shifted_es_reference(checkpoint, block_size):
    from vllm import SamplingParams

    mask_id = json.loads((checkpoint / "config.json").read_text())["mask_token_id"]
    reference = ReferenceFastDLLMv2(checkpoint)
    cases = [(case, name) for case in CASES for name in PROMPTS]
    want = {(case, name): reference_es_shifted_generate(
        reference, PROMPTS[name], block_size=block_size, mask_id=mask_id,
        max_tokens=MAX_TOKENS, skip_layers=SKIP_LAYERS,
        **OPTIONS, **{**DEFAULTS, **CASES[case]}) for case, name in cases}
    assert len({tuple(v) for v in want.values()}) > len(PROMPTS)  # the cases differ

    def params(case):
        # the whole block as one sub-block (the family's default 8 would confine commits)
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                              extra_args={**OPTIONS, **CASES[case],
                                          "sub_block_size": block_size})

    with diffusion_llm(checkpoint, diffusion_block_size=block_size, max_num_seqs=16,
                       additional_config={"diffusion_policy": "es",
                                          "skip_layers": list(SKIP_LAYERS)}) as llm:
        assert_equal_alone_and_batched(llm, PROMPTS, cases, params, want)
