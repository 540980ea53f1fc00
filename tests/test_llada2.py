"""LLaDA2 (``llada2_moe``) in the engine: the published config and weight names load
without remote code, the mask token comes from the tokenizer and the block size defaults
to 32, routing equals the published router, and greedy output equals the plain-PyTorch
reference of the published forward on the SDAR generation loop, for ``standard`` and for
``focus`` with a budget that keeps the whole block."""

from __future__ import annotations

import pytest
import torch
from conftest import diffusion_llm
from reference_llada2 import ReferenceLLaDA2, reference_route
from reference_sdar import reference_generate
from test_parity import make_prompts

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from vllm_diffusion.models.llada2 import route
from vllm_diffusion_lab.fixtures.tiny_llada2 import MASK_TOKEN, build_tiny_llada2
from vllm_diffusion_lab.offline import stats_delta

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def llada2_checkpoint(tmp_path_factory):
    return build_tiny_llada2(tmp_path_factory.mktemp("llada2"))


def token_info(checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return tokenizer.convert_tokens_to_ids(MASK_TOKEN), {tokenizer.eos_token_id}, len(tokenizer)


@pytest.mark.parametrize("experts,groups,topk_group,top_k", [
    (8, 4, 2, 2), (16, 4, 1, 3), (8, 2, 2, 1), (32, 8, 4, 8)])
def test_router_equals_the_published_routing(experts, groups, topk_group, top_k):
    gen = torch.Generator().manual_seed(experts * 10 + top_k)
    logits = torch.randn(40, experts, generator=gen) * 2
    bias = torch.randn(experts, generator=gen) * 0.5
    got_w, got_ids = route(None, logits, top_k, False, expert_bias=bias, num_groups=groups,
                           topk_group=topk_group, scaling=2.5)
    want_w, want_ids = reference_route(logits, bias, top_k, groups, topk_group, 2.5)
    order_got, order_want = got_ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order_got.values, order_want.values)
    torch.testing.assert_close(got_w.gather(1, order_got.indices),
                               want_w.gather(1, order_want.indices))


def test_each_moe_layer_routes_like_the_published_router(llada2_checkpoint):
    """Every MoE layer of the checkpoint, on random hidden states: the plugin's router
    (fp32 gate and ``route``) picks the experts and weights the reference picks."""
    from safetensors.torch import load_file

    from vllm_diffusion.models.configs import LLaDA2MoeConfig
    from vllm_diffusion.models.llada2 import LLaDA2Router

    config = LLaDA2MoeConfig.from_pretrained(llada2_checkpoint)
    weights = load_file(str(llada2_checkpoint / "model.safetensors"))
    hidden = torch.randn(64, config.hidden_size, generator=torch.Generator().manual_seed(1))
    layers = range(config.first_k_dense_replace, config.num_hidden_layers)
    assert len(layers) >= 2
    for layer in layers:
        router = LLaDA2Router(config)
        router.weight.data.copy_(weights[f"model.layers.{layer}.mlp.gate.weight"])
        router.expert_bias.data.copy_(weights[f"model.layers.{layer}.mlp.gate.expert_bias"])
        got_w, got_ids = route(hidden, router(hidden), config.num_experts_per_tok, False,
                               expert_bias=router.expert_bias, num_groups=config.n_group,
                               topk_group=config.topk_group,
                               scaling=config.routed_scaling_factor)
        logits = hidden @ weights[f"model.layers.{layer}.mlp.gate.weight"].T
        want_w, want_ids = reference_route(
            logits, weights[f"model.layers.{layer}.mlp.gate.expert_bias"],
            config.num_experts_per_tok, config.n_group, config.topk_group,
            config.routed_scaling_factor)
        got, want = got_ids.sort(dim=-1), want_ids.sort(dim=-1)
        assert torch.equal(got.values, want.values), layer
        torch.testing.assert_close(got_w.gather(1, got.indices), want_w.gather(1, want.indices))


def generate(checkpoint, prompts, block_size, max_tokens, policy="standard", options=None):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args=options)
    config = {"diffusion_policy": policy}
    if block_size is not None:
        config["diffusion_block_size"] = block_size
    with diffusion_llm(checkpoint, additional_config=config) as llm:
        resolved = llm.llm_engine.vllm_config.additional_config
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], resolved


@pytest.mark.parametrize("block_size,strategy,max_tokens", [
    (8, "low_confidence_dynamic", 19), (None, "threshold", 35)], ids=["b8", "b32-default"])
def test_greedy_output_equals_the_reference(llada2_checkpoint, block_size, strategy,
                                            max_tokens):
    """The same prompt-length mix as the SDAR parity tests (shorter than a block, one
    block, several blocks and a tail); outputs end inside a block."""
    mask_id, stops, vocab_size = token_info(llada2_checkpoint)
    size = block_size or 32
    prompts = make_prompts(size, vocab_size, stops | {mask_id}, seed=size)
    options = {"strategy": strategy, "threshold": 0.7}
    got, resolved = generate(llada2_checkpoint, prompts, block_size, max_tokens,
                             options=options)
    assert resolved.block_size == size and resolved.mask_token_id == mask_id
    reference = ReferenceLLaDA2(llada2_checkpoint)
    for prompt, tokens in zip(prompts, got):
        assert tokens == reference_generate(reference, prompt, block_size=size, mask_id=mask_id,
                                            max_tokens=max_tokens, **options)


def test_focus_keeping_the_whole_block_equals_the_reference(llada2_checkpoint):
    """FOCUS's eviction after layer 1 (the first MoE layer) with a budget that never evicts
    (alpha large) and no intra-block cache decodes like the reference."""
    mask_id, stops, vocab_size = token_info(llada2_checkpoint)
    prompts = make_prompts(8, vocab_size, stops | {mask_id}, seed=3)
    options = {"strategy": "low_confidence_dynamic", "threshold": 0.7, "alpha": 64.0,
               "intra_block_cache": False}
    got, _ = generate(llada2_checkpoint, prompts, 8, 19, policy="focus", options=options)
    reference = ReferenceLLaDA2(llada2_checkpoint)
    for prompt, tokens in zip(prompts, got):
        assert tokens == reference_generate(reference, prompt, block_size=8, mask_id=mask_id,
                                            max_tokens=19, strategy="low_confidence_dynamic",
                                            threshold=0.7)


def test_served_with_focus_chat_metrics_and_step_map(llada2_checkpoint, tmp_path):
    """``vllm serve <llada2> --diffusion-policy focus``: the Ling chat template through
    /v1/chat/completions, a completion with its step map, and the diffusion metrics."""
    import requests
    from test_server import metric

    from vllm_diffusion_lab.fixtures.server import vllm_server

    with vllm_server(llada2_checkpoint, "--diffusion-policy", "focus", "--max-model-len", "256",
                     "--max-num-seqs", "4", "--enforce-eager",
                     log_path=tmp_path / "serve.log") as url:
        model = str(llada2_checkpoint)
        chat = requests.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": model, "temperature": 0, "max_tokens": 12, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me about the river."}]})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] == 12
        completion = requests.post(f"{url}/v1/completions", timeout=60, json={
            "model": model, "prompt": "The river", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "vllm_xargs": {"return_step_map": True}})
        assert completion.status_code == 200, completion.text
        assert len(completion.json()["kv_transfer_params"]["diffusion_step_map"]) == 40
        assert metric(url, "vllm:diffusion_num_committed_tokens_total") >= 52


EDITING = {"b8-threshold-post2": ("standard", 8, "threshold", 0.7, 0.5, 2),
           "b8-dynamic-post16": ("standard", 8, "low_confidence_dynamic", 0.9, 0.3, 16),
           "b16-static-post0": ("standard", 16, "low_confidence_static", 0.9, 0.4, 0),
           "focus-b8-threshold": ("focus", 8, "threshold", 0.7, 0.5, 4)}


@pytest.mark.parametrize("case", EDITING.values(), ids=EDITING.keys())
def test_token_editing_equals_the_reference(llada2_checkpoint, case):
    """LLaDA2.1 editing (``editing_threshold``, ``max_post_steps``): outputs and step maps
    (the step of each token's last change) equal the reference loop's, with more than
    half of the blocks seeing at least one edit (the engine's counters), and
    editing changes the output (so the test can tell it from plain filling). FOCUS edits
    with its eviction and intra-block cache off (the configuration where editing
    applies)."""
    from reference_llada2 import reference_generate_editing

    policy, block_size, strategy, threshold, editing, post = case
    mask_id, stops, vocab_size = token_info(llada2_checkpoint)
    prompts = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=60 + block_size)
    max_tokens = 2 * block_size + 3
    options = {"strategy": strategy, "threshold": threshold, "editing_threshold": editing,
               "max_post_steps": post}
    if policy == "focus":
        options.update(evict=False, intra_block_cache=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args={**options, "return_step_map": True})
    with diffusion_llm(llada2_checkpoint, diffusion_block_size=block_size,
                       additional_config={"diffusion_policy": policy}) as llm:
        before = llm.collective_rpc("diffusion_stats")[0]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               use_tqdm=False)
        stats = stats_delta(before, llm.collective_rpc("diffusion_stats")[0])
    assert stats["edited_blocks_completed"] > stats["blocks_completed"] / 2, stats
    reference = ReferenceLLaDA2(llada2_checkpoint)
    plain = []
    for prompt, output in zip(prompts, outputs):
        tokens, step_map = reference_generate_editing(
            reference, prompt, block_size=block_size, mask_id=mask_id, max_tokens=max_tokens,
            strategy=strategy, threshold=threshold, editing_threshold=editing,
            max_post_steps=post)
        assert list(output.outputs[0].token_ids) == tokens
        assert output.kv_transfer_params["diffusion_step_map"] == step_map
        plain.append(reference_generate(reference, prompt, block_size=block_size,
                                        mask_id=mask_id, max_tokens=max_tokens,
                                        strategy=strategy, threshold=threshold))
    assert [list(o.outputs[0].token_ids) for o in outputs] != plain


def test_a_stable_end_commits_with_the_last_forwards_kv(llada2_checkpoint):
    """A block ending on a post step that changed nothing is committed without being
    recomputed (that forward computed it whole with its final tokens); the outputs still
    equal the reference loop's."""
    from reference_llada2 import reference_generate_editing

    mask_id, stops, vocab_size = token_info(llada2_checkpoint)
    prompts = make_prompts(8, vocab_size, stops | {mask_id}, seed=70)
    options = {"strategy": "threshold", "threshold": 0.7, "editing_threshold": 0.95,
               "max_post_steps": 4}
    params = SamplingParams(temperature=0, max_tokens=19, ignore_eos=True, extra_args=options)
    with diffusion_llm(llada2_checkpoint, diffusion_block_size=8) as llm:
        before = llm.collective_rpc("diffusion_stats")[0]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               use_tqdm=False)
        stats = stats_delta(before, llm.collective_rpc("diffusion_stats")[0])
    assert stats["commits_reused"] > 0, stats
    reference = ReferenceLLaDA2(llada2_checkpoint)
    for prompt, output in zip(prompts, outputs):
        tokens, _ = reference_generate_editing(reference, prompt, block_size=8,
                                               mask_id=mask_id, max_tokens=19, **options)
        assert list(output.outputs[0].token_ids) == tokens


def test_edited_tokens_are_emitted_only_when_their_block_ends(llada2_checkpoint):
    block_size = 8
    mask_id, stops, vocab_size = token_info(llada2_checkpoint)
    prompt = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=4)[-1]
    params = SamplingParams(temperature=0, max_tokens=3 * block_size, ignore_eos=True,
                            extra_args={"strategy": "threshold", "threshold": 0.7,
                                        "editing_threshold": 0.5})
    with diffusion_llm(llada2_checkpoint, diffusion_block_size=block_size) as llm:
        engine = llm.llm_engine
        engine.add_request("edits", TokensPrompt(prompt_token_ids=prompt), params)
        lengths = []
        while engine.has_unfinished_requests():
            for output in engine.step():
                lengths.append(len(output.outputs[0].token_ids))
    assert lengths[-1] == 3 * block_size
    for length in lengths:  # every emission completes a block (or the request)
        assert (len(prompt) + length) % block_size == 0 or length == 3 * block_size


@pytest.mark.parametrize("policy,cases", [
    ("focus", [({}, "intra_block_cache"), ({"intra_block_cache": False}, "'evict'")]),
    ("es", [({}, "skip_ratio")]),
    ("standard", [({"chunk_size": 4}, "chunk_size")]),
    ("ada", [({}, "unknown option")]),
])
def test_editing_is_refused_where_it_cannot_apply(llada2_checkpoint, policy, cases):
    engine_options = {"skip_layers": [1]} if policy == "es" else {}
    with diffusion_llm(llada2_checkpoint, diffusion_block_size=8,
                       additional_config={"diffusion_policy": policy, **engine_options}) as llm:
        for options, message in cases:
            params = SamplingParams(temperature=0, max_tokens=4,
                                    extra_args={**options, "editing_threshold": 0.5})
            with pytest.raises(Exception, match=message):
                llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], params,
                             use_tqdm=False)


def test_the_elastic_policy_refuses_editing():
    from vllm_diffusion.options import OptionError
    from vllm_diffusion.policies.elastic import ElasticConfig

    with pytest.raises(OptionError, match="elastic policy"):
        ElasticConfig(chunk_reuse=False, editing_threshold=0.5).validate_for_block(8, "x")
