"""LLaDA2.2 in the engine: block routing equals its per-token reference on a named grid,
the joint editing loop (mask-to-token and token-to-token writes that may be DELETE or
SPLIT) equals the reference loop token for token and step for step wherever the random
anti-loop does not fire (elsewhere: the invariants), with edits, deletions and splits
counted; what cannot compose with it is refused with the reason; served chat works."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import diffusion_llm
from reference_llada22 import (ReferenceLLaDA22, reference_block_route,
                               reference_generate_joint)

from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import StructuredOutputsParams

from vllm_diffusion.models.llada2 import (block_pool_logits, route_in_pool,
                                          routing_blocks)
from vllm_diffusion_lab.fixtures.tiny_llada2 import MASK_TOKEN, build_tiny_llada2
from vllm_diffusion_lab.offline import stats_delta

ROUTING_BLOCK = 8

# name: (experts, capacity, top_k, routing block, rows per request as (first position, count))
ROUTING_GRID = {
    "one-request-two-blocks": (8, 4, 2, 8, [(0, 16)]),
    "prefill-and-block": (16, 6, 3, 4, [(0, 12), (32, 8)]),
    "same-blocks-two-requests": (8, 3, 1, 8, [(8, 8), (8, 8)]),
    "capacity-equals-experts": (8, 8, 2, 8, [(16, 16), (0, 8)]),
    "capacity-equals-top-k": (32, 8, 8, 16, [(0, 32), (48, 16), (16, 16)]),
    "ties-go-to-the-lower-id": (16, 5, 2, 8, [(0, 16), (8, 8)]),
}


@pytest.mark.parametrize("name", ROUTING_GRID)
def test_block_routing_equals_the_reference(name):
    experts, capacity, top_k, block, layout = ROUTING_GRID[name]
    gen = torch.Generator().manual_seed(experts + capacity)
    positions = torch.cat([torch.arange(first, first + count) for first, count in layout])
    logits = torch.randn(len(positions), experts, generator=gen) * 3
    bias = torch.randn(experts, generator=gen) * 0.1
    if name.startswith("ties"):  # three distinct scores: block and token scores tie
        logits, bias = torch.randint(-1, 2, logits.shape, generator=gen).float(), bias * 0
    got_w, got_ids = block_route(logits, positions, bias, top_k, capacity, block, 2.5)
    want_w, want_ids = reference_block_route(logits, positions, bias, top_k, capacity, block,
                                             2.5)
    got, want = got_ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(got.values, want.values)
    torch.testing.assert_close(got_w.gather(1, got.indices), want_w.gather(1, want.indices))
    if capacity < experts:  # the pool matters: plain top-k over all experts differs
        plain = (torch.sigmoid(logits) + bias).topk(top_k, dim=-1).indices.sort(-1).values
        assert not torch.equal(plain, got_ids.sort(dim=-1).values)



def block_route(gating_output: torch.Tensor, positions: torch.Tensor,
                expert_bias: torch.Tensor, top_k: int, capacity: int,
                routing_block_size: int, scaling: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The block routing of a forward's rows as ``LLaDA2MoE`` composes it (the pool before
    vLLM's fused MoE, the per-token choice inside it): ([T, k] weights, [T, k] expert
    ids) from fp32 router logits [T, E] and the rows' positions [T]."""
    pooled = block_pool_logits(gating_output, routing_blocks(positions, routing_block_size),
                               expert_bias, capacity)
    return route_in_pool(None, pooled, top_k, False, expert_bias=expert_bias,
                         scaling=scaling)

def test_routing_blocks_split_requests_and_blocks():
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7, 8, 9, 10, 11])
    assert routing_blocks(positions, 4).tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Edit tokens boosted so that DELETE and SPLIT are written often."""
    return build_tiny_llada2(tmp_path_factory.mktemp("llada22"), expert_capacity=4,
                             routing_block_size=ROUTING_BLOCK, edit_logit_scale=1.5)


def model_info(checkpoint):
    from transformers import AutoTokenizer

    config = json.loads((checkpoint / "config.json").read_text())
    mask = AutoTokenizer.from_pretrained(checkpoint).convert_tokens_to_ids(MASK_TOKEN)
    return config, mask


def joint_prompts(config, count=4, seed=0):
    """Prompt lengths from shorter than a routing block to several blocks and a tail."""
    prompts = []
    for i in range(count):
        gen = torch.Generator().manual_seed(seed + i)
        prompts.append(torch.randint(5, config["vocab_size"] - 2, (3 + 5 * i + 7 * (i // 3),),
                                     generator=gen).tolist())
    return prompts


def run_engine(checkpoint, prompts, block_size, max_tokens, options, **llm_kwargs):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args={**options, "return_step_map": True})
    with diffusion_llm(checkpoint, diffusion_block_size=block_size, **llm_kwargs) as llm:
        before = llm.collective_rpc("diffusion_stats")[0]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               use_tqdm=False)
        stats = stats_delta(before, llm.collective_rpc("diffusion_stats")[0])
    return outputs, stats


def assert_invariants(tokens, config, mask, max_tokens):
    assert len(tokens) == max_tokens
    assert not {mask, config["delete_token_id"], config["split_token_id"]} & set(tokens)


def count_exact(checkpoint, prompts, outputs, options, block_size=8, max_tokens=19,
                step_maps=False) -> int:
    """Every output keeps the invariants; those whose reference run did not fire the
    anti-loop equal it (and their step maps, with ``step_maps``). Returns their number."""
    config, mask = model_info(checkpoint)
    settings = {"threshold": 0.5, "editing_threshold": 0.0, "max_post_steps": 16, **options}
    reference = ReferenceLLaDA22(checkpoint)
    exact = 0
    for prompt, output in zip(prompts, outputs):
        tokens, step_map, fired = reference_generate_joint(
            reference, prompt, block_size=block_size, mask_id=mask,
            delete=config["delete_token_id"], split=config["split_token_id"],
            max_tokens=max_tokens, **settings)
        got = list(output.outputs[0].token_ids)
        assert_invariants(got, config, mask, max_tokens)
        if not fired:
            assert got == tokens
            if step_maps:
                assert output.kv_transfer_params["diffusion_step_map"] == step_map
            exact += 1
    return exact


# name: (block size, options, max_num_seqs, eager)
JOINT_CASES = {
    "editing-off": (8, {"editing_threshold": None, "max_post_steps": 16}, 8, True),
    "edit-0.5-post4": (8, {"editing_threshold": 0.5, "max_post_steps": 4}, 8, True),
    "edit-0.3-post0": (8, {"editing_threshold": 0.3, "max_post_steps": 0}, 8, True),
    "edit-0.9-stable-ends": (8, {"editing_threshold": 0.9, "max_post_steps": 4}, 8, True),
    "published-defaults": (8, {}, 8, True),
    "b16-two-routing-blocks": (16, {"editing_threshold": 0.5, "max_post_steps": 2}, 8, True),
    "chunked-prefill": (8, {"editing_threshold": 0.5, "max_post_steps": 4}, 2, True),
    "step-cap": (8, {"editing_threshold": 0.0, "max_post_steps": 16,
                     "max_steps_per_block": 6}, 8, True),
    "compiled": (8, {"editing_threshold": 0.5, "max_post_steps": 4}, 8, False),
}


@pytest.mark.engine
@pytest.mark.parametrize("case", JOINT_CASES.values(), ids=JOINT_CASES.keys())
def test_joint_decoding_equals_the_reference(checkpoint, case):
    block_size, options, max_num_seqs, eager = case
    prompts = joint_prompts(model_info(checkpoint)[0], seed=block_size)
    if max_num_seqs == 2:  # prompts over the step's token budget: prefilled in chunks
        prompts = [p * 5 for p in prompts[1:3]]
    max_tokens = 2 * block_size + 3
    outputs, stats = run_engine(checkpoint, prompts, block_size, max_tokens, options,
                                max_num_seqs=max_num_seqs, enforce_eager=eager)
    exact = count_exact(checkpoint, prompts, outputs, options, block_size, max_tokens,
                        step_maps=True)
    assert exact >= len(prompts) // 2, "too few cases compared exactly"
    assert stats["tokens_deleted"] + stats["tokens_split"] > 0, stats
    if options.get("editing_threshold") == 0.9:  # blocks that end stably are committed
        assert stats["commits_reused"] > 0, stats  # with their last forward's KV
    if options.get("max_steps_per_block"):
        assert stats["denoising_steps"] <= stats["blocks_completed"] * 6, stats


@pytest.mark.engine
def test_eos_is_looked_for_among_generated_positions_only(checkpoint):
    """An EOS in the prompt tail (the first block's fixed positions) ends nothing; the
    output stops where the reference loop finds EOS among generated positions."""
    config, mask = model_info(checkpoint)
    eos = config["eos_token_id"]
    prompts = [p[:-2] + [eos] + p[-1:] for p in joint_prompts(config, seed=30)]
    options = {"editing_threshold": 0.5, "max_post_steps": 4}
    params = SamplingParams(temperature=0, max_tokens=40, extra_args=options)
    with diffusion_llm(checkpoint, diffusion_block_size=8) as llm:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               use_tqdm=False)
    reference = ReferenceLLaDA22(checkpoint)
    for prompt, output in zip(prompts, outputs):
        tokens, _, fired = reference_generate_joint(
            reference, prompt, block_size=8, mask_id=mask, delete=config["delete_token_id"],
            split=config["split_token_id"], max_tokens=40, threshold=0.5,
            stop_token_ids={eos}, **options)
        got = list(output.outputs[0].token_ids)
        assert got, "the prompt's EOS ended the request"
        if not fired:
            assert got == tokens


@pytest.mark.engine
def test_focus_with_its_full_budget_equals_the_reference(checkpoint):
    """FOCUS without eviction or intra-block cache computes whole blocks: it decodes
    LLaDA2.2 as the reference loop does; a request asking to evict is refused."""
    prompts = joint_prompts(model_info(checkpoint)[0], seed=20)
    options = {"editing_threshold": 0.5, "max_post_steps": 4}
    focus = {"diffusion_policy": "focus", "evict": False, "intra_block_cache": False}
    params = SamplingParams(temperature=0, max_tokens=19, ignore_eos=True, extra_args=options)
    with diffusion_llm(checkpoint, diffusion_block_size=8, additional_config=focus) as llm:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               use_tqdm=False)
        with pytest.raises(Exception, match="'evict'"):
            llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], SamplingParams(
                temperature=0, max_tokens=4, extra_args={"evict": True}), use_tqdm=False)
    assert count_exact(checkpoint, prompts, outputs, options) >= 2


@pytest.mark.engine
def test_preempted_requests_decode_as_with_room_and_aborts_free_kv(checkpoint):
    """A preempted request keeps its block's joint state (original masks, post count, the
    states seen) and recomputes its KV: it decodes as in an engine with room. A request
    aborted mid-block leaves no KV held."""
    from conftest import assert_abort_mid_block_frees_kv, outputs_with_and_without_room

    prompts = [TokensPrompt(prompt_token_ids=p)
               for p in joint_prompts(model_info(checkpoint)[0], count=8, seed=40)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                            extra_args={"editing_threshold": 0.5, "max_post_steps": 4})
    outputs, _ = outputs_with_and_without_room(checkpoint, prompts, params)
    assert outputs[True] == outputs[False]
    with diffusion_llm(checkpoint, diffusion_block_size=8) as llm:
        assert_abort_mid_block_frees_kv(llm, params)


@pytest.mark.engine
def test_the_edit_ids_at_the_published_vocabulary(tmp_path):
    """DELETE and SPLIT at the real checkpoints' ids (156930, 156931) in a vocabulary of
    the published size."""
    checkpoint = build_tiny_llada2(tmp_path / "real-ids", expert_capacity=4,
                                   routing_block_size=ROUTING_BLOCK, vocab_size=157184,
                                   edit_token_ids=(156930, 156931), edit_logit_scale=4.0,
                                   num_layers=2, hidden_size=32, head_dim=16)
    prompts = joint_prompts({"vocab_size": 200}, count=3, seed=4)
    options = {"editing_threshold": 0.5, "max_post_steps": 4}
    outputs, stats = run_engine(checkpoint, prompts, 8, 19, options)
    assert count_exact(checkpoint, prompts, outputs, options) >= 1
    assert stats["tokens_deleted"] + stats["tokens_split"] > 0, stats


@pytest.mark.engine
def test_what_cannot_compose_is_refused(checkpoint):
    for policy in ("es", "elastic", "sparse_prefix", "ada"):
        with pytest.raises(Exception, match=f"the {policy} policy cannot serve LLaDA2.2"):
            with diffusion_llm(checkpoint, diffusion_block_size=8,
                               additional_config={"diffusion_policy": policy}):
                pass
    with pytest.raises(Exception, match="focus policy cannot serve LLaDA2.2: it computes "
                       "whole blocks only with its full budget"):
        with diffusion_llm(checkpoint, diffusion_block_size=8,
                           additional_config={"diffusion_policy": "focus",
                                              "intra_block_cache": False}):
            pass
    with pytest.raises(Exception, match="standard policy cannot serve LLaDA2.2: options "
                       "'chunk_size' and 'chunk_reuse'"):
        with diffusion_llm(checkpoint, diffusion_block_size=8,
                           additional_config={"chunk_reuse": True, "editing_threshold": None}):
            pass
    with pytest.raises(Exception, match="multiple of it"):
        with diffusion_llm(checkpoint, diffusion_block_size=4):
            pass
    refused = [({"temperature": 0.7}, "temperature"),
               ({"logprobs": 1}, "logprobs"),
               ({"min_tokens": 2}, "min_tokens"),
               ({"extra_args": {"chunk_size": 4}}, "chunk_size"),
               ({"extra_args": {"chunk_reuse": True, "editing_threshold": None}},
                "standard policy cannot serve LLaDA2.2: options 'chunk_size' and "
                "'chunk_reuse'"),
               ({"extra_args": {"strategy": "sequential"}}, "strategy"),
               ({"extra_args": {"max_steps_per_block": 5000}}, "max_steps_per_block_limit"),
               ({"extra_args": {"max_post_steps": 65}}, "max_post_steps_limit"),
               ({"extra_args": {"editing_threshold": None},
                 "structured_outputs": StructuredOutputsParams(regex="a+")},
                "structured_outputs")]
    with diffusion_llm(checkpoint, diffusion_block_size=8) as llm:
        for fields, message in refused:
            params = SamplingParams(**{"temperature": 0, "max_tokens": 4, **fields})
            with pytest.raises(Exception, match=message):
                llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], params,
                             use_tqdm=False)
        ok = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])],
                          SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert len(ok[0].outputs[0].token_ids) <= 4


@pytest.mark.engine
def test_served_chat_with_step_map(checkpoint, tmp_path):
    import requests
    from test_server import metric

    from vllm_diffusion_lab.fixtures.server import vllm_server

    with vllm_server(checkpoint, "--max-model-len", "256", "--max-num-seqs", "4",
                     "--enforce-eager", "--additional-config",
                     json.dumps({"diffusion_block_size": 8}),
                     log_path=tmp_path / "serve.log") as url:
        model = str(checkpoint)
        chat = requests.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": model, "temperature": 0, "max_tokens": 12, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me about the river."}],
            "vllm_xargs": {"return_step_map": True}})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] == 12
        assert len(chat.json()["kv_transfer_params"]["diffusion_step_map"]) == 12
        bad = requests.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": model, "temperature": 0.8, "max_tokens": 12,
            "messages": [{"role": "user", "content": "Tell me about the river."}]})
        assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]
        assert metric(url, "vllm:diffusion_num_committed_tokens_total") >= 12
        text = requests.get(f"{url}/metrics", timeout=10).text
        edits = {kind: f'kind="{kind}"' in text for kind in ("substitution", "deletion",
                                                               "split")}
        assert any(edits.values()), "no token edit counted"
        assert metric(url, "vllm:diffusion_num_token_edits_total") > 0
