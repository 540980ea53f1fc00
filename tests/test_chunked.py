"""Chunked decoding (Optimus, streaming reorganisation) against a plain reference loop.

The reference, written here from the paper (section 4.4) on top of the SDAR reference
model: at every step the chunk is the first ``chunk_size`` undecided positions of the
block; the model reads the committed prefix and the block up to the chunk's last position
(decoded positions included, as context; nothing to the right of the chunk), or the whole
block once no more than a chunk is undecided, with the block-causal mask; only the chunk's positions may be committed, by the same unmasking rule
and step quotas as whole-block decoding (past the block's step budget, the quota is the
whole block and the threshold rule commits everything computed).
"""

from __future__ import annotations

import pytest
import torch
from conftest import diffusion_llm
from reference_sdar import (ReferenceSDAR, block_causal_mask, reference_generate,
                            select_positions, transfer_quotas)
from test_parity import checkpoint_info, make_prompts

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt

pytestmark = pytest.mark.engine


def reference_chunked_generate(model, prompt_ids, *, block_size, chunk_size, mask_id,
                               max_tokens, strategy, threshold, stop_token_ids):
    quotas = transfer_quotas(block_size, block_size)
    block_start = len(prompt_ids) // block_size * block_size
    committed = list(prompt_ids[:block_start])
    tail = prompt_ids[block_start:]
    block = torch.tensor(tail + [mask_id] * (block_size - len(tail)))
    output: list[int] = []
    while True:
        step = 0
        while bool((block == mask_id).any()):
            masked = block == mask_id
            undecided = torch.nonzero(masked).flatten()
            end = block_size if len(undecided) <= chunk_size else int(undecided[chunk_size - 1]) + 1
            chunk = undecided[:chunk_size]
            tokens = torch.cat((torch.tensor(committed, dtype=torch.long), block[:end]))
            logits = model.forward(tokens, block_causal_mask(len(tokens), block_size))[-end:]
            logits[:, mask_id] = float("-inf")
            probs = logits.float().softmax(dim=-1)
            proposal = torch.full((block_size,), mask_id)
            proposal[:end] = probs.argmax(dim=-1)
            in_chunk = torch.zeros(block_size, dtype=torch.bool)
            in_chunk[chunk] = True
            confidence = torch.full((block_size,), float("-inf"))
            confidence[:end] = probs.max(dim=-1).values
            confidence = torch.where(in_chunk, confidence, torch.full_like(confidence,
                                                                           float("-inf")))
            quota = quotas[step] if step < block_size else block_size
            chosen = select_positions(strategy, confidence, in_chunk, quota, threshold,
                                      last_step=step >= block_size - 1)
            block = torch.where(chosen, proposal, block)
            step += 1
        for position, token in enumerate(block.tolist(), start=block_start):
            if position < len(prompt_ids):
                continue
            output.append(token)
            if token in stop_token_ids or len(output) == max_tokens:
                return output
        committed.extend(block.tolist())
        block_start += block_size
        block = torch.full((block_size,), mask_id)


@pytest.mark.parametrize("block_size,chunk_size", [(8, 2), (16, 4), (16, 16)])
@pytest.mark.parametrize("strategy", ["threshold", "low_confidence_dynamic", "sequential"])
def test_chunked_decoding_equals_the_reference(dense_checkpoint, block_size, chunk_size,
                                               strategy):
    mask_id, stops, vocab_size = checkpoint_info(dense_checkpoint)
    model = ReferenceSDAR(dense_checkpoint)
    prompts = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=41)
    options = {"strategy": strategy, "threshold": 0.6}
    max_tokens = 2 * block_size + 3
    params = SamplingParams(temperature=0, max_tokens=max_tokens,
                            extra_args={**options, "chunk_size": chunk_size})
    with diffusion_llm(dense_checkpoint, diffusion_block_size=block_size) as llm:
        before = llm.collective_rpc("diffusion_stats")[0]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               use_tqdm=False)
        after = llm.collective_rpc("diffusion_stats")[0]
    for prompt, out in zip(prompts, outputs):
        want = reference_chunked_generate(
            model, prompt, block_size=block_size, chunk_size=chunk_size, mask_id=mask_id,
            max_tokens=max_tokens, stop_token_ids=stops, **options)
        assert list(out.outputs[0].token_ids) == want
        if chunk_size == block_size:  # whole-block decoding, the published loop
            assert want == reference_generate(model, prompt, block_size=block_size,
                                              mask_id=mask_id, max_tokens=max_tokens,
                                              stop_token_ids=stops, **options)
    steps = after["denoising_steps"] - before["denoising_steps"]
    rows = after["block_positions_computed"] - before["block_positions_computed"]
    if chunk_size < block_size:  # a step computes at most the block up to its chunk
        assert rows < steps * block_size


def test_chunk_reuse_computes_fewer_rows_and_keeps_committed_kv_exact(dense_checkpoint):
    """With reuse, decoded positions outside the chunk keep their KV (the intra-block
    cache's rule); commits stay exact, so a later request sharing the prefix through the
    prefix cache decodes as if alone."""
    block_size, chunk_size = 16, 4
    mask_id, stops, vocab_size = checkpoint_info(dense_checkpoint)
    prompts = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=42)
    work = {}
    with diffusion_llm(dense_checkpoint, diffusion_block_size=block_size) as llm:
        for reuse in (False, True):
            params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, extra_args={
                "strategy": "threshold", "threshold": 0.6, "chunk_size": chunk_size,
                "chunk_reuse": reuse})
            before = llm.collective_rpc("diffusion_stats")[0]
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                   use_tqdm=False)
            after = llm.collective_rpc("diffusion_stats")[0]
            work[reuse] = (after["block_positions_computed"] - before["block_positions_computed"],
                           [len(o.outputs[0].token_ids) for o in outputs])
    assert work[True][1] == work[False][1] == [40, 40, 40]
    assert work[True][0] < work[False][0]


def test_chunk_options_are_validated(dense_checkpoint):
    with diffusion_llm(dense_checkpoint, diffusion_block_size=8) as llm:
        with pytest.raises(VLLMValidationError, match="'chunk_size' must divide the block"):
            llm.generate("hello", SamplingParams(max_tokens=2, extra_args={"chunk_size": 3}),
                         use_tqdm=False)
    with diffusion_llm(dense_checkpoint, diffusion_block_size=8,
                       additional_config={"diffusion_policy": "focus"}) as llm:
        with pytest.raises(VLLMValidationError, match="unknown option.*'chunk_size'.*policy 'focus'"):
            llm.generate("hello", SamplingParams(max_tokens=2, extra_args={"chunk_size": 4}),
                         use_tqdm=False)


def test_a_shrinking_window_never_caches_a_position_it_left_out():
    """Chunk reuse with a chunk that changes between steps (as ``elastic`` chooses it):
    block 8, chunk 8 -> 2 -> 8. Positions 4-6 are decoded by the first step (their KV made
    from the mask token); the second step's window covers positions 0-1 only, so 4 and 5,
    though they and their right neighbours are decoded, must stay uncached until a step
    computes them with their tokens (the third), and only then be reused."""
    import torch

    from vllm_diffusion.policies.parts.chunk_window import ChunkWindow
    from vllm_diffusion.step.request import BlockCanvas

    mask = 99
    window = ChunkWindow(8)
    canvas = BlockCanvas(0, torch.full((8,), mask))

    def step(chunk, commit):
        plan = window.plan(canvas, mask, chunk, reuse=True)
        computed = plan.compute if plan.compute is not None else torch.ones(8, dtype=torch.bool)
        masked_before = canvas.masked(mask)
        positions = torch.zeros(8, dtype=torch.bool)
        positions[commit] = True
        assert bool((positions <= computed).all())  # only computed positions commit
        canvas.commit(positions, torch.where(positions, torch.arange(8), canvas.tokens))
        window.after_step(masked_before, computed, reuse=True)
        return computed

    assert bool(step(None, [4, 5, 6]).all())
    narrow = step(2, [0])
    assert narrow.tolist() == [True, True] + [False] * 6
    assert bool(window.cache.uncached[4]) and bool(window.cache.uncached[5])  # not reused
    wide = step(None, [1])
    assert bool(wide[4]) and bool(wide[5])  # recomputed with their tokens
    assert not bool(window.cache.uncached[4]) and not bool(window.cache.uncached[5])
