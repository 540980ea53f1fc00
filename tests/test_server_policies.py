"""``vllm serve --diffusion-policy es|ada|elastic`` on loopback: completions, streaming, the step
map, per-request options and the diffusion metrics."""

from __future__ import annotations

import json
import re

import pytest
import requests
from test_server import metric, stream_chat, stream_logprobs

from vllm_diffusion_lab.fixtures.server import vllm_server
from vllm_diffusion_lab.fixtures.tiny_sdar import build_tiny_sdar

pytestmark = pytest.mark.engine


def layer_positions(url: str) -> dict[int, float]:
    """``vllm:diffusion_num_layer_positions_total`` by its 'layer' label."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    found = re.findall(r'^vllm:diffusion_num_layer_positions_total\{[^}]*layer="(\d+)"[^}]*\} '
                       r'([0-9.e+-]+)$', text, re.MULTILINE)
    return {int(layer): float(value) for layer, value in found}


@pytest.mark.parametrize("policy,options,bad_option", [
    ("es", {"skip_ratio": 0.5, "alpha": 0.5}, {"skip_ratio": 2.0}),
    ("ada", {"capacity": 0.3}, {"capacity": 0}),
    ("elastic", {}, {"chunk_size": 3})])
def test_policy_serves_completions_stream_and_step_map(policy, options, bad_option,
                                                       tmp_path_factory):
    checkpoint = build_tiny_sdar(tmp_path_factory.mktemp("sdar-4-layers"), num_layers=4, seed=3)
    log = tmp_path_factory.mktemp("server") / "serve.log"
    with vllm_server(checkpoint, "--diffusion-policy", policy,
                     "--additional-config", json.dumps({"diffusion_block_size": 16}),
                     "--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager",
                     log_path=log) as url:
        model = str(checkpoint)
        body = {"model": model, "prompt": "The river", "max_tokens": 20, "temperature": 0,
                "ignore_eos": True, "vllm_xargs": {**options, "return_step_map": True}}
        response = requests.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        completion = response.json()
        assert completion["usage"]["completion_tokens"] == 20
        assert len(completion["kv_transfer_params"]["diffusion_step_map"]) == 20
        deltas = stream_chat({"url": url, "model": model}, {
            "model": model, "temperature": 0, "max_tokens": 12, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me about the river."}]})
        assert deltas
        chat = {"model": model, "temperature": 0, "max_tokens": 12, "ignore_eos": True,
                "logprobs": True, "top_logprobs": 2, "bad_words": ["the"],
                "messages": [{"role": "user", "content": "Tell me about the river."}]}
        entries = stream_logprobs({"url": url, "model": model}, chat)
        assert len(entries) == 12 and all(len(e["top_logprobs"]) == 2 for e in entries)
        bad = requests.post(f"{url}/v1/completions", timeout=60,
                            json={**body, "vllm_xargs": bad_option})
        assert bad.status_code == 400
        assert next(iter(bad_option)) in bad.text
        positions = metric(url, "vllm:diffusion_num_canvas_positions_total")
        later = metric(url, "vllm:diffusion_num_positions_after_eviction_total")
        assert metric(url, "vllm:diffusion_num_committed_tokens_total") >= 32
        per_layer = layer_positions(url)
        assert sorted(per_layer) == [0, 1, 2, 3] and per_layer[3] == later
        if policy == "elastic":  # no profile: learned; the chosen chunks are exported
            text = requests.get(f"{url}/metrics", timeout=10).text
            assert re.search(r'^vllm:diffusion_chosen_chunk_steps_total\{[^}]*chunk="\d+"',
                             text, re.MULTILINE)
        if policy == "es":  # positions skipped after layer 2 do not reach layer 3
            assert later < positions and per_layer[0] == per_layer[2] > per_layer[3]
        else:  # ada computes fewer positions but drops none inside the forward
            assert later == positions and len(set(per_layer.values())) == 1
