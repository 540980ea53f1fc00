"""Compiled execution: with vLLM's default compilation (on CPU: the forward traced once
into one graph, guards dropped, attention as an opaque custom op) the standard policy's
greedy output equals the reference across block sizes, batch sizes and prompt lengths in
one engine, so nothing is frozen at the traced shapes (policies with forward hooks:
``test_compiled_hooks.py``)."""

from __future__ import annotations

import pytest
from conftest import diffusion_llm
from reference_sdar import ReferenceSDAR, reference_generate
from test_parity import checkpoint_info, make_prompts

from vllm import SamplingParams
from vllm.config import CompilationMode
from vllm.inputs import TokensPrompt

from vllm_diffusion_lab.offline import stats_delta

pytestmark = pytest.mark.engine

# (checkpoint, block size, strategy)
GRID = {
    "dense-b4-dynamic": ("dense", 4, "low_confidence_dynamic"),
    "dense-b16-threshold": ("dense", 16, "threshold"),
    "moe-b8-static": ("moe", 8, "low_confidence_static"),
}


@pytest.mark.parametrize("name", GRID)
def test_compiled_standard_equals_the_reference_at_every_shape(name, dense_checkpoint,
                                                               moe_checkpoint):
    kind, block_size, strategy = GRID[name]
    checkpoint = dense_checkpoint if kind == "dense" else moe_checkpoint
    mask_id, stops, vocab_size = checkpoint_info(checkpoint)
    reference = ReferenceSDAR(checkpoint)
    prompts = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=70 + block_size)
    options = {"strategy": strategy, "threshold": 0.7}
    max_tokens = 2 * block_size + 3
    params = SamplingParams(temperature=0, max_tokens=max_tokens, extra_args=options)
    with diffusion_llm(checkpoint, diffusion_block_size=block_size,
                       enforce_eager=False) as llm:
        config = llm.llm_engine.vllm_config.compilation_config
        assert config.mode != CompilationMode.NONE  # the forward really is compiled
        before = llm.collective_rpc("diffusion_stats")[0]
        # Batches of 1, 3 and 2 requests: different row counts through one traced graph.
        for batch in (prompts[:1], prompts, prompts[1:]):
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params,
                                   use_tqdm=False)
            for prompt, out in zip(batch, outputs):
                assert list(out.outputs[0].token_ids) == reference_generate(
                    reference, prompt, block_size=block_size, mask_id=mask_id,
                    max_tokens=max_tokens, stop_token_ids=stops, **options)
        stats = stats_delta(before, llm.collective_rpc("diffusion_stats")[0])
    layers = len(stats["block_positions_per_layer"])
    assert stats["block_positions_per_layer"] == [stats["block_positions_computed"]] * layers
