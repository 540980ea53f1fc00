"""FOCUS on a model whose logits are shifted (Fast-dLLM v2's form, the default model's):
greedy output equal to the plain-PyTorch reference (``reference_focus_shifted``, importing
no package code) token for token on a named grid -- eviction and the intra-block cache
together and each alone, block sizes 8 and 16, prompts shorter than a block, of exactly
one block (the first token by the autoregressive step) and ending inside the second --
alone and in one batch; eviction computing fewer later-layer rows; the delayed commit
refused with its reason."""

from __future__ import annotations

import json
import pathlib

import pytest

from conftest import diffusion_llm, token_prompts
from reference_fast_dllm_v2 import ReferenceFastDLLMv2
from reference_focus_shifted import reference_focus_shifted_generate

from vllm_diffusion_lab.fixtures.tiny_fast_dllm_v2 import build_tiny_fast_dllm_v2

pytestmark = pytest.mark.engine

MAX_TOKENS = 24
PROMPTS = {"short": [11, 12, 13, 14, 15], "one-block": list(range(40, 56)),
           "tail": list(range(60, 81))}
# named option sets (threshold 0.5 on a random model: mostly one token a step); each
# request sets the sub-block to the whole block (the family's default sub-blocks of 8
# would confine commits to one; the reference decodes whole blocks)
CASES = {"evict-and-cache": {}, "evict-only": {"intra_block_cache": False},
         "cache-only": {"evict": False}}
OPTIONS = {"strategy": "threshold", "threshold": 0.5, "alpha": 1.5}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> pathlib.Path:
    return build_tiny_fast_dllm_v2(tmp_path_factory.mktemp("fast-dllm-v2-focus"),
                                   bd_size=16, num_layers=4)


@pytest.mark.parametrize("block_size", [8, 16])
def test_focus_equals_the_shifted_focus_reference(checkpoint, block_size):
    from vllm import SamplingParams

    from vllm_diffusion.policies.focus import FocusConfig

    mask_id = json.loads((checkpoint / "config.json").read_text())["mask_token_id"]
    reference = ReferenceFastDLLMv2(checkpoint)
    cases = [(case, name) for case in CASES for name in PROMPTS]
    want = {(case, name): reference_focus_shifted_generate(
        reference, PROMPTS[name], block_size=block_size, mask_id=mask_id,
        max_tokens=MAX_TOKENS, config=FocusConfig(**OPTIONS, **CASES[case]))
        for case, name in cases}
    assert len({tuple(v) for v in want.values()}) > len(PROMPTS)  # the cases differ

    def params(case):
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                              extra_args={**OPTIONS, **CASES[case],
                                          "sub_block_size": block_size})

    with diffusion_llm(checkpoint, diffusion_block_size=block_size, max_num_seqs=16,
                       additional_config={"diffusion_policy": "focus"}) as llm:
        assert_equal_alone_and_batched(llm, PROMPTS, cases, params, want)


def assert_equal_alone_and_batched(llm, prompts: dict, cases: list, params, want: dict
                                   ) -> None:
    """Each (case, prompt name) of ``cases`` alone, then all in one batch, gives ``want``'s
    tokens; and the step's hooks dropped rows (fewer block rows went through the later
    layers than were computed)."""
    before = llm.collective_rpc("diffusion_stats")[0]
    assert_alone_and_batched(llm, prompts, cases, params, want)
    after = llm.collective_rpc("diffusion_stats")[0]
    assert (after["block_positions_after_eviction"] - before["block_positions_after_eviction"]
            < after["block_positions_computed"] - before["block_positions_computed"])


def assert_alone_and_batched(llm, prompts: dict, cases: list, params, want: dict) -> None:
    """Each (case, prompt name) of ``cases`` alone, then all in one batch, gives ``want``'s
    tokens (``params(case)``: its sampling parameters)."""
    for case, name in cases:
        alone = llm.generate(token_prompts([prompts[name]]), params(case),
                             use_tqdm=False)[0].outputs[0]
        assert list(alone.token_ids) == want[case, name], (case, name)
    batch = llm.generate(token_prompts([prompts[name] for _, name in cases]),
                         [params(case) for case, _ in cases], use_tqdm=False)
    for key, output in zip(cases, batch):
        assert list(output.outputs[0].token_ids) == want[key], key


def test_the_delayed_commit_is_refused_where_logits_are_shifted(checkpoint):
    with pytest.raises(Exception, match="the focus policy cannot serve Fast-dLLM v2: it "
                       "computes whole blocks only with its full budget.*logits are shifted"):
        with diffusion_llm(checkpoint, diffusion_block_size=16, enable_prefix_caching=False,
                           additional_config={"diffusion_policy": "focus",
                                              "commit": "delayed"}):
            pass
