"""Checks of the plain-PyTorch SDAR reference that the plugin is compared against."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from reference_sdar import (
    STRATEGIES,
    ReferenceSDAR,
    block_causal_mask,
    reference_generate,
    reference_generate_trace,
    select_positions,
    transfer_quotas,
)

from vllm_diffusion_lab.fixtures.tiny_sdar import build_tiny_sdar

BLOCK_SIZE = 4
INF = float("inf")


@pytest.fixture(autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["dense", "moe"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny_sdar_{request.param}")
    return build_tiny_sdar(path, moe=request.param == "moe", block_size=BLOCK_SIZE)


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory):
    return ReferenceSDAR(build_tiny_sdar(tmp_path_factory.mktemp("tiny_sdar_dense"), block_size=BLOCK_SIZE))


def _generate(model: ReferenceSDAR, prompt: list[int], **kwargs):
    kwargs.setdefault("block_size", BLOCK_SIZE)
    kwargs.setdefault("mask_id", model.config["mask_token_id"])
    return reference_generate_trace(model, prompt, **kwargs)


def test_block_causal_mask_rule():
    expected = torch.tensor(
        [
            [1, 1, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0],
            [1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(block_causal_mask(5, 2), expected)
    assert torch.equal(block_causal_mask(6, 1), torch.ones(6, 6, dtype=torch.bool).tril())
    assert block_causal_mask(7, 4).shape == (7, 7)
    assert block_causal_mask(7, 4)[1, 3] and not block_causal_mask(7, 4)[3, 4]


def test_transfer_quotas():
    assert transfer_quotas(4, 4) == [1, 1, 1, 1]
    assert transfer_quotas(4, 3) == [2, 1, 1]
    assert transfer_quotas(8, 3) == [3, 3, 2]
    assert transfer_quotas(4, 1) == [4]


def test_select_positions_hand_examples():
    masked = torch.tensor([True, True, False, True])
    conf = torch.tensor([0.95, 0.5, -INF, 0.5])

    def chosen(strategy, quota, threshold=0.9, last_step=False):
        picked = select_positions(strategy, conf, masked, quota, threshold, last_step)
        return picked.nonzero().flatten().tolist()

    assert chosen("low_confidence_dynamic", 1) == [0]  # one above threshold covers the quota
    assert chosen("low_confidence_dynamic", 2) == [0, 1]  # fallback to top-2; tie -> lower position
    assert chosen("low_confidence_dynamic", 1, threshold=0.95) == [0]  # strict: top-1 fallback
    assert chosen("low_confidence_static", 2) == [0, 1]
    assert chosen("low_confidence_static", 5) == [0, 1, 3]  # quota capped by the masks left
    assert chosen("sequential", 2) == [0, 1]
    assert chosen("threshold", 1, threshold=0.5) == [0, 1, 3]  # >= threshold
    assert chosen("threshold", 1, threshold=0.99) == [0]  # always the top-1
    assert chosen("threshold", 1, threshold=0.99, last_step=True) == [0, 1, 3]


def _as_transformers_checkpoint(checkpoint, destination):
    """Same weights, config renamed to transformers' own Qwen3 / Qwen3-MoE."""
    config = json.loads((checkpoint / "config.json").read_text())
    if config["model_type"] == "sdar_moe":
        config.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"])
        config["num_local_experts"] = config["num_experts"]  # transformers 5.x name
    else:
        config.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    destination.mkdir()
    (destination / "config.json").write_text(json.dumps(config))
    shutil.copy(checkpoint / "model.safetensors", destination / "model.safetensors")
    return destination


def test_forward_matches_transformers(checkpoint, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_dir = _as_transformers_checkpoint(checkpoint, tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, attn_implementation="eager", dtype=torch.float32
    ).eval()
    model = ReferenceSDAR(checkpoint)
    length = 23
    generator = torch.Generator().manual_seed(0)
    token_ids = torch.randint(0, model.config["vocab_size"], (length,), generator=generator)
    with torch.no_grad():
        expected = hf_model(token_ids[None]).logits[0]
    actual = model.forward(token_ids, torch.ones(length, length, dtype=torch.bool).tril())
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-5)


def test_block_causal_forward_sees_own_block_not_later_ones(dense_model):
    token_ids = torch.randint(4, 500, (12,), generator=torch.Generator().manual_seed(1))
    mask = block_causal_mask(12, BLOCK_SIZE)
    logits = dense_model.forward(token_ids, mask)
    changed = token_ids.clone()
    changed[6] = (changed[6] + 1) % 500  # a token in block 1 (positions 4..7)
    changed_logits = dense_model.forward(changed, mask)
    torch.testing.assert_close(changed_logits[:4], logits[:4], rtol=0, atol=0)  # earlier block
    assert not torch.allclose(changed_logits[4:6], logits[4:6])  # earlier positions of the same block


def test_first_committed_token_is_greedy_at_first_mask(dense_model):
    mask_id = dense_model.config["mask_token_id"]
    prompt = [17, 42, 99, 123, 7]  # P = 5: the first block holds prompt[4] and 3 masks
    output = reference_generate(
        dense_model, prompt, block_size=BLOCK_SIZE, mask_id=mask_id, max_tokens=1, strategy="sequential"
    )
    tokens = torch.tensor(prompt + [mask_id] * 3)
    logits = dense_model.forward(tokens, block_causal_mask(8, BLOCK_SIZE))[5]
    logits[mask_id] = -INF
    assert output == [int(logits.argmax())]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("denoising_steps", [None, 2, 3])
def test_every_block_finishes_within_steps(dense_model, strategy, denoising_steps):
    steps = denoising_steps or BLOCK_SIZE
    for prompt in ([5, 6, 7], [5, 6, 7, 8, 9, 10, 11, 12]):
        trace = _generate(
            dense_model, prompt, max_tokens=10, strategy=strategy, denoising_steps=denoising_steps
        )
        assert len(trace.output_ids) == 10
        assert dense_model.config["mask_token_id"] not in trace.output_ids
        assert all(1 <= n <= steps for n in trace.steps_per_block)
        if strategy in ("sequential", "low_confidence_static") and steps == BLOCK_SIZE:
            # One token per step: a block takes as many steps as it has masks.
            first_block_masks = BLOCK_SIZE - len(prompt) % BLOCK_SIZE
            later_blocks = len(trace.steps_per_block) - 1
            assert trace.steps_per_block == [first_block_masks] + [BLOCK_SIZE] * later_blocks


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_stops_at_max_tokens_and_stop_token(dense_model, strategy):
    prompt = [30, 31, 32, 33, 34, 35]
    full = _generate(dense_model, prompt, max_tokens=14, strategy=strategy).output_ids
    assert len(full) == 14
    assert _generate(dense_model, prompt, max_tokens=5, strategy=strategy).output_ids == full[:5]
    # Stopping on the token emitted at index 6 (in the middle of a block) keeps it and nothing after.
    stop = full[6]
    first = full.index(stop)
    stopped = _generate(dense_model, prompt, max_tokens=14, strategy=strategy, stop_token_ids={stop})
    assert stopped.output_ids == full[: first + 1]
