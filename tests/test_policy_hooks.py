"""Every hook point of the policy interface, driven by test policies in a real engine.

A policy is a class registered in ``POLICIES``; these two exist only here:

- ``keep-everything`` declares all three hook points at every layer, keeps every row and
  every key (through the row-dropping and the prefix-sparse attention paths, keeping the
  whole prefix): its greedy output must equal ``standard``'s token for token;
- ``leftmost-only`` drops, after the last layer's output, every block row except the
  leftmost masked one: with the ``sequential`` strategy (which commits exactly the leftmost
  masked position) the output must again equal ``standard``'s, while only one block
  position per request reaches the logits.
"""

from __future__ import annotations

import pytest
import torch
from conftest import diffusion_llm
from test_parity import checkpoint_info, make_prompts

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from vllm_diffusion import policies
from vllm_diffusion.policies.standard import StandardPolicy
from vllm_diffusion.step.hooks import LayerHooks, RowSelection, StepHooks
from vllm_diffusion.step.keys import KeySelection
from vllm_diffusion_lab.offline import stats_delta

pytestmark = pytest.mark.engine
NUM_LAYERS = 2  # the tiny test checkpoint's depth


class KeepEverythingHooks(StepHooks):
    layers = LayerHooks(before_attention=tuple(range(NUM_LAYERS)),
                        after_output=tuple(range(NUM_LAYERS)),
                        select_keys=tuple(range(NUM_LAYERS)))

    def __init__(self, step):
        self.step = step
        self.calls = []

    def before_attention(self, layer_input):
        assert layer_input.query.shape[0] == layer_input.key.shape[0] == len(layer_input.rows)
        self.calls.append(("before_attention", layer_input.layer))
        return RowSelection(torch.ones(len(layer_input.rows), dtype=torch.bool))

    def after_output(self, layer_input):
        self.calls.append(("after_output", layer_input.layer))
        return RowSelection(torch.ones(len(layer_input.rows), dtype=torch.bool))

    def select_keys(self, layer_input):
        """Every request with a block keeps its whole prefix (the sparse attention path)."""
        self.calls.append(("select_keys", layer_input.layer))
        requests = self.step.requests
        sparse = [i for i, s in enumerate(requests) if s.request is not None]
        prefix_lens = [0 if s.request is None else s.request.canvas.start for s in requests]
        width = max([1] + prefix_lens)
        kept = torch.arange(width).repeat(len(sparse), layer_input.key.shape[1], 1)
        for row, i in enumerate(sparse):
            kept[row, :, prefix_lens[i]:] = -1
        block_rows = [0 if s.block_rows is None else len(s.block_rows) for s in requests]
        return KeySelection(block_rows, prefix_lens, sparse, kept, [])


class KeepEverything(StandardPolicy):
    name = "keep-everything"
    seen_calls: list = []

    def forward_hooks(self, step):
        hooks = KeepEverythingHooks(step)
        KeepEverything.seen_calls = hooks.calls
        return hooks


class LeftmostOnlyHooks(StepHooks):
    layers = LayerHooks(after_output=(NUM_LAYERS - 1,))

    def __init__(self, step, mask_token_id):
        self.step, self.mask_token_id = step, mask_token_id

    def after_output(self, layer_input):
        keep = torch.ones(len(layer_input.rows), dtype=torch.bool)
        for s in self.step.requests:
            if s.request is None:
                continue
            masked = s.request.canvas.masked(self.mask_token_id)[s.block_positions]
            keep[layer_input.current_rows(s.block_rows)] = False
            keep[layer_input.current_rows(s.block_rows[masked][:1])] = True
        return RowSelection(keep)


class LeftmostOnly(StandardPolicy):
    name = "leftmost-only"

    def forward_hooks(self, step):
        return LeftmostOnlyHooks(step, self.mask_token_id)


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(policies.POLICIES, KeepEverything.name, KeepEverything)
    monkeypatch.setitem(policies.POLICIES, LeftmostOnly.name, LeftmostOnly)


def generate(checkpoint, policy, prompts, block_size, strategy):
    params = SamplingParams(temperature=0, max_tokens=2 * block_size + 3, ignore_eos=True,
                            extra_args={"strategy": strategy})
    with diffusion_llm(checkpoint, diffusion_block_size=block_size,
                       additional_config={"diffusion_policy": policy}) as llm:
        before = llm.collective_rpc("diffusion_stats")[0]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               use_tqdm=False)
        after = llm.collective_rpc("diffusion_stats")[0]
    stats = stats_delta(before, after)
    return [list(o.outputs[0].token_ids) for o in outputs], stats


@pytest.mark.parametrize("policy,strategy", [("keep-everything", "low_confidence_dynamic"),
                                             ("leftmost-only", "sequential")])
def test_hooks_that_change_nothing_decided_decode_like_standard(registered, dense_checkpoint,
                                                                policy, strategy):
    block_size = 8
    mask_id, stops, vocab_size = checkpoint_info(dense_checkpoint)
    prompts = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=31)
    want, standard_stats = generate(dense_checkpoint, "standard", prompts, block_size, strategy)
    got, stats = generate(dense_checkpoint, policy, prompts, block_size, strategy)
    assert got == want
    if policy == "keep-everything":
        points = {point for point, _ in KeepEverything.seen_calls}
        assert points == {"before_attention", "after_output", "select_keys"}
        assert stats["block_positions_after_eviction"] == stats["block_positions_computed"]
    else:  # one block row per denoising step reaches the logits
        assert stats["block_positions_after_eviction"] == stats["denoising_steps"]
        assert stats["block_positions_computed"] == standard_stats["block_positions_computed"]
    # Rows leave only after the last layer's output: every layer computed every block row.
    assert stats["block_positions_per_layer"] == [stats["block_positions_computed"]] * NUM_LAYERS
