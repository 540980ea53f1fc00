"""A real ``vllm serve`` with the plugin on loopback: streaming of final tokens, metrics,
request validation, bursts, client disconnects and clean shutdown. Bounded in time."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import time

import pytest
import requests

from vllm_diffusion_lab.fixtures.server import vllm_server

pytestmark = pytest.mark.engine

BLOCK_SIZE = 16
MAX_NUM_SEQS = 4
SEQUENTIAL = {"strategy": "sequential"}  # one token per step: many steps per block


@pytest.fixture(scope="module")
def server(dense_checkpoint, tmp_path_factory):
    """The server, its log, and ``stop`` (SIGINT and wait; the last test stops it to read
    the whole log, else the fixture's teardown does)."""
    log = tmp_path_factory.mktemp("server") / "serve.log"
    with contextlib.ExitStack() as running:
        url = running.enter_context(vllm_server(
            dense_checkpoint, "--diffusion-policy", "standard",
            "--additional-config", json.dumps({"diffusion_block_size": BLOCK_SIZE}),
            "--max-model-len", "512", "--max-num-seqs", str(MAX_NUM_SEQS),
            "--enforce-eager", log_path=log))
        yield {"url": url, "model": str(dense_checkpoint), "log": log, "stop": running.close}


def metric(url: str, name: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    values = re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert values, f"{name} not in /metrics"
    return sum(float(v) for v in values)


def wait_until_idle(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (metric(url, "vllm:num_requests_running") == 0
                and metric(url, "vllm:kv_cache_usage_perc") == 0):
            return
        time.sleep(0.5)
    raise AssertionError("requests or KV blocks still held after the client went away")


def chat_body(server, **extra):
    return {"model": server["model"], "temperature": 0, "max_tokens": 12, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me about the river."}], **extra}


def streamed_choices(server, body) -> list[dict]:
    """The first choice of every chunk of a streamed chat completion, in order."""
    choices = []
    with requests.post(f"{server['url']}/v1/chat/completions", json={**body, "stream": True},
                       stream=True, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                choices.append(json.loads(line[6:])["choices"][0])
    return choices


def stream_chat(server, body) -> list[str]:
    """The content deltas of a streamed chat completion."""
    return [c["delta"]["content"] for c in streamed_choices(server, body)
            if c["delta"].get("content")]


def stream_logprobs(server, body) -> list[dict]:
    """The logprob entries of a streamed chat completion, in order."""
    return [e for c in streamed_choices(server, body)
            for e in (c.get("logprobs") or {}).get("content") or []]


def test_streamed_chat_sends_final_tokens_before_the_block_completes(server):
    body = chat_body(server, vllm_xargs=SEQUENTIAL)
    deltas = stream_chat(server, body)
    whole = requests.post(f"{server['url']}/v1/chat/completions", json=body, timeout=60).json()
    assert "".join(deltas) == whole["choices"][0]["message"]["content"]
    assert whole["usage"]["completion_tokens"] == 12
    # 12 tokens span at most two blocks of 16: block-at-a-time output would be <= 2 chunks.
    assert len(deltas) >= 6, deltas


def test_metrics_report_diffusion_counters(server):
    steps = metric(server["url"], "vllm:diffusion_num_denoising_steps_total")
    requests.post(f"{server['url']}/v1/chat/completions",
                  json=chat_body(server, vllm_xargs=SEQUENTIAL), timeout=60).raise_for_status()
    assert metric(server["url"], "vllm:diffusion_num_denoising_steps_total") >= steps + 12
    positions = metric(server["url"], "vllm:diffusion_num_canvas_positions_total")
    committed = metric(server["url"], "vllm:diffusion_num_committed_tokens_total")
    assert committed >= 12 and positions >= BLOCK_SIZE * committed / 2
    # The standard policy evicts nothing: every block position reaches the later layers.
    assert metric(server["url"], "vllm:diffusion_num_positions_after_eviction_total") == positions


def test_step_map_is_returned_on_request(server):
    body = chat_body(server, vllm_xargs={**SEQUENTIAL, "return_step_map": True})
    response = requests.post(f"{server['url']}/v1/chat/completions", json=body, timeout=60).json()
    steps = response["kv_transfer_params"]["diffusion_step_map"]
    # Sequential unmasking: one token per denoising step, in order.
    assert len(steps) == response["usage"]["completion_tokens"] == 12
    assert steps == sorted(steps) and len(set(steps)) == 12
    completion = requests.post(f"{server['url']}/v1/completions", timeout=60, json={
        "model": server["model"], "prompt": "The river", "max_tokens": 5, "temperature": 0,
        "ignore_eos": True, "vllm_xargs": {"return_step_map": True}}).json()
    assert len(completion["kv_transfer_params"]["diffusion_step_map"]) == 5


def test_invalid_option_is_a_400_and_the_server_keeps_serving(server):
    response = requests.post(f"{server['url']}/v1/chat/completions",
                             json=chat_body(server, vllm_xargs={"threshold": 2.0}), timeout=30)
    assert response.status_code == 400
    assert "option 'threshold' must be float in [0.0, 1.0]" in response.json()["error"]["message"]
    response = requests.post(f"{server['url']}/v1/completions", timeout=30, json={
        "model": server["model"], "prompt": "hi", "max_tokens": 4, "prompt_logprobs": 2})
    assert response.status_code == 400 and "prompt_logprobs" in response.text
    ok = requests.post(f"{server['url']}/v1/chat/completions", json=chat_body(server), timeout=60)
    assert ok.status_code == 200


def test_burst_larger_than_max_num_seqs_completes_alongside_a_bad_request(server):
    def send(i):
        extra = {"vllm_xargs": {"threshold": -1}} if i == 5 else {}
        body = chat_body(server, **extra)
        body["messages"][0]["content"] += f" number {i}"
        return requests.post(f"{server['url']}/v1/chat/completions", json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(send, range(3 * MAX_NUM_SEQS)))
    codes = [r.status_code for r in responses]
    assert codes[5] == 400 and codes.count(200) == len(codes) - 1
    assert all(r.json()["usage"]["completion_tokens"] == 12 for r in responses if r.ok)
    wait_until_idle(server["url"])


def test_client_disconnect_mid_stream_frees_the_request(server):
    body = chat_body(server, max_tokens=400, vllm_xargs=SEQUENTIAL, stream=True)
    with requests.post(f"{server['url']}/v1/chat/completions", json=body, stream=True,
                       timeout=60) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]  # a few deltas, mid-block
    assert any(line.startswith(b"data: ") for line in received)
    wait_until_idle(server["url"])
    # The server is still healthy and serving.
    assert requests.post(f"{server['url']}/v1/chat/completions", json=chat_body(server),
                         timeout=60).status_code == 200



def test_logprobs_streamed_and_not_and_bad_words_through_the_server(server):
    """logprobs and top_logprobs in chat and completions, streamed and not: one entry per
    returned token, the same values either way; a bad word never appears in the output."""
    body = chat_body(server, logprobs=True, top_logprobs=2, vllm_xargs=SEQUENTIAL)
    whole = requests.post(f"{server['url']}/v1/chat/completions", json=body, timeout=60).json()
    entries = whole["choices"][0]["logprobs"]["content"]
    assert len(entries) == whole["usage"]["completion_tokens"] == 12
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in entries)
    streamed = stream_logprobs(server, body)
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in entries])
    completion = requests.post(f"{server['url']}/v1/completions", timeout=60, json={
        "model": server["model"], "prompt": "The river", "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "logprobs": 1}).json()
    assert len(completion["choices"][0]["logprobs"]["token_logprobs"]) == 6
    text = whole["choices"][0]["message"]["content"]
    word = text.strip().split()[0] if text.strip() else "the"
    banned = requests.post(f"{server['url']}/v1/chat/completions", timeout=60,
                           json=chat_body(server, bad_words=[word])).json()
    assert word not in banned["choices"][0]["message"]["content"].split()


def test_beam_search_and_generative_scoring_run_on_token_logprobs(server):
    """vLLM's beam search (one-token generations with logprobs=2 x width) and the
    generative-scoring endpoint (logprob_token_ids) run on the plugin's per-token
    logprobs."""
    beams = requests.post(f"{server['url']}/v1/completions", timeout=120, json={
        "model": server["model"], "prompt": "The river", "max_tokens": 3,
        "use_beam_search": True, "n": 2})
    assert beams.status_code == 200, beams.text
    assert len(beams.json()["choices"]) == 2
    scored = requests.post(f"{server['url']}/generative_scoring", timeout=60, json={
        "model": server["model"], "query": "The river", "items": ["a", "b"],
        "label_token_ids": [36, 37]})
    assert scored.status_code == 200, scored.text
    assert "error" not in scored.json()


def test_structured_output_through_the_server(server):
    """response_format json_schema (chat) and structured_outputs regex (completions) are
    enforced; an invalid schema is a 400 and the server keeps serving."""
    import jsonschema

    schema = {"type": "object", "properties": {"id": {"type": "integer"},
                                               "tag": {"enum": ["red", "blue"]}},
              "required": ["id", "tag"], "additionalProperties": False}
    response = requests.post(f"{server['url']}/v1/chat/completions", timeout=60, json={
        **chat_body(server, max_tokens=60), "ignore_eos": False, "response_format": {
            "type": "json_schema", "json_schema": {"name": "item", "schema": schema}}})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    completion = requests.post(f"{server['url']}/v1/completions", timeout=60, json={
        "model": server["model"], "prompt": "The river", "max_tokens": 20, "temperature": 0,
        "structured_outputs": {"regex": "[a-c]{4}-[0-9]{2}"}}).json()
    assert re.fullmatch("[a-c]{4}-[0-9]{2}", completion["choices"][0]["text"])
    bad = requests.post(f"{server['url']}/v1/chat/completions", timeout=60, json={
        **chat_body(server), "response_format": {
            "type": "json_schema", "json_schema": {"name": "x",
                                                   "schema": {"type": "no-such-type"}}}})
    assert bad.status_code == 400
    assert requests.post(f"{server['url']}/v1/chat/completions", json=chat_body(server),
                         timeout=60).status_code == 200
    assert metric(server["url"], "vllm:diffusion_num_grammar_fills_total") > 0
    assert metric(server["url"], "vllm:diffusion_num_grammar_accepts_total") >= 6


def test_client_mistakes_and_a_normal_stop_leave_a_quiet_truthful_log(server):
    """Runs last (it stops the server). A 400 in a stream and on /v1/messages is one INFO
    line each; the log of the whole run, start-up to the normal stop (SIGINT), holds no
    ERROR line, no traceback, no leak report (nanobind's, the resource tracker's) and not
    both of vLLM's contradicting Triton lines."""
    url, model = server["url"], server["model"]
    with requests.post(f"{url}/v1/chat/completions", stream=True, timeout=60, json={
            **chat_body(server), "stream": True, "vllm_xargs": {"no_such_option": 1}}
            ) as response:
        assert '"code": 400' in response.text and "no_such_option" in response.text
    messages = requests.post(f"{url}/v1/messages", timeout=60, json={
        "model": model, "max_tokens": 4, "top_k": -5,
        "messages": [{"role": "user", "content": "Hi"}]})
    assert messages.status_code == 400, messages.text
    server["stop"]()
    log = server["log"].read_text()
    assert "Traceback" not in log and not re.search(r"\bERROR\b", log), log[-4000:]
    assert "leaked" not in log, log[-4000:]
    assert not ("Triton is not installed" in log and "doesn't include CPU backend" in log)
    client_errors = [line for line in log.splitlines() if "Error, HTTP 400)" in line]
    assert len(client_errors) >= 2, client_errors
    assert all(" INFO " in line for line in client_errors), client_errors
