"""A hostile client against `vllm serve --diffusion-policy focus` on loopback: every bad
input of the catalogue is a 400 naming the problem, a storm of aborted and disconnected
requests leaves nothing held, and output at temperature 0 never changes. Bounded in time."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import signal
import socket
import threading
import time

import pytest
import requests
from test_server import chat_body, metric, stream_logprobs, wait_until_idle

from vllm_diffusion_lab.fixtures.server import vllm_server, vllm_server_process

pytestmark = pytest.mark.engine

BLOCK_SIZE = 16
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def server(dense_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("focus-server") / "serve.log"
    with vllm_server(dense_checkpoint, "--diffusion-policy", "focus", "--enforce-eager",
                     "--additional-config", json.dumps({"diffusion_block_size": BLOCK_SIZE}),
                     "--max-model-len", "512", "--max-num-seqs", "8", log_path=log) as url:
        yield {"url": url, "model": str(dense_checkpoint)}


def post_json(url: str, body: dict, timeout: float) -> requests.Response:
    """POST with NaN / Infinity written as JSON literals (requests' json= refuses them)."""
    return requests.post(url, data=json.dumps(body), timeout=timeout,
                         headers={"Content-Type": "application/json"})


@pytest.fixture(scope="module")
def reference(server) -> str:
    return complete(server)


def complete(server) -> str:
    response = requests.post(f"{server['url']}/v1/chat/completions", json=chat_body(
        server, max_tokens=24, vllm_xargs={"threshold": 0.7}), timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


# (request fields, text the 400's message must contain); NaN and Infinity go out as the
# JSON literals NaN / Infinity, as Python's json writes them.
CATALOGUE = [
    ({"vllm_xargs": {"alpha": NAN}}, "option 'alpha' must be a finite float"),
    ({"vllm_xargs": {"alpha": "nan"}}, "option 'alpha' must be a finite float"),
    ({"vllm_xargs": {"alpha": INF}}, "option 'alpha' must be a finite float"),
    ({"vllm_xargs": {"alpha": "-inf"}}, "option 'alpha' must be a finite float"),
    ({"vllm_xargs": {"alpha": 1.0}}, "option 'alpha' must be float in (1.0, 64.0]"),
    ({"vllm_xargs": {"threshold": NAN}}, "option 'threshold' must be a finite float"),
    ({"vllm_xargs": {"threshold": "NaN"}}, "option 'threshold' must be a finite float"),
    ({"vllm_xargs": {"pool_kernel": 2}}, "option 'pool_kernel' must be odd"),
    ({"vllm_xargs": {"pool_kernel": NAN}}, "option 'pool_kernel' must be int"),
    ({"vllm_xargs": {"evict": "maybe"}}, "option 'evict' must be bool"),
    ({"vllm_xargs": {"strategy": "fastest"}}, "option 'strategy' must be one of"),
    ({"vllm_xargs": {"denoising_steps": 99}}, "'denoising_steps' must be at most the block"),
    ({"vllm_xargs": {"commit": "delayed"}}, "option 'commit' is engine-wide"),
    ({"vllm_xargs": {"alpah": 2.0}}, "unknown option(s) 'alpah'"),
    ({"vllm_xargs": {"diffusion_policy": "standard"}}, "per-request policy switching"),
    ({"vllm_xargs": {"return_step_map": True}, "n": 2, "temperature": 1.0},
     "return_step_map requires n=1"),
    ({"temperature": NAN}, "temperature"),
    ({"temperature": INF}, "temperature"),
    ({"top_p": NAN}, "top_p"),
    ({"seed": 2**70}, "seed"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"logprobs": True, "top_logprobs": 30}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"structured_outputs": {"regex": "a+"}, "logprobs": True}, "structured_outputs: logprobs"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"frequency_penalty": 5.0}, "frequency_penalty"),
    # the engine-wide limits on what multiplies a request's work, at their defaults
    ({"n": 17, "temperature": 1.0}, "n=17 asks for 17 outputs, each decoded as a request "
     "of its own, more than this server allows: diffusion_max_n=16"),
    ({"bad_words": [f"word{i}" for i in range(65)]},
     "bad_words holds 65 words, more than this server allows: diffusion_max_bad_words=64"),
    ({"bad_words": [" ".join(map(str, range(1100)))]},
     "more than this server allows: diffusion_max_bad_word_tokens=1024"),
    ({"bad_words": ["x" * 20_000]}, "bad_words hold 20000 characters, which cannot "
     "tokenize within the token limit unless their tokens average more than 16 characters, "
     "more than this server allows: diffusion_max_bad_word_tokens=1024"),
    ({"structured_outputs": {"regex": "a" * 70_000}},
     "the constraint has 70000 characters (regex 70000), more than this server allows: "
     "diffusion_max_grammar_chars=65536"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "large", "schema": {"type": "string", "description": "x" * 70_000}}}},
     "more than this server allows: diffusion_max_grammar_chars=65536"),
    ({"vllm_xargs": {"max_post_steps": 65}},
     "'max_post_steps' must be at most the engine's 'max_post_steps_limit' (64), got 65"),
    ({"vllm_xargs": {"max_steps_per_block": 1001}},
     "'max_steps_per_block' must be at most the engine's 'max_steps_per_block_limit' "
     "(1000), got 1001"),
    # vLLM would clamp a non-finite bias into [-100, 100] (NaN to -100)
    ({"logit_bias": {"42": NAN}}, "finite numbers, got nan for token 42"),
    ({"logit_bias": {"42": INF}}, "finite numbers, got inf for token 42"),
    ({"logit_bias": {"42": "NaN"}}, "finite numbers, got nan for token 42"),
    ({"logit_bias": {"42": "inf"}}, "finite numbers, got inf for token 42"),
    ({"logit_bias": {"5": 1.0, "42": "-Infinity"}}, "finite numbers, got -inf for token 42"),
    # vllm_xargs' schema would turn a JSON true into 1
    ({"vllm_xargs": {"threshold": True}},
     "option 'threshold' must be float in [0.0, 1.0], got True"),
    ({"vllm_xargs": {"pool_kernel": True}}, "option 'pool_kernel' must be int"),
]


@pytest.mark.parametrize("fields, message", CATALOGUE,
                         ids=[json.dumps(f)[:60] for f, _ in CATALOGUE])
def test_bad_input_is_a_400_naming_the_problem(server, reference, fields, message):
    response = post_json(f"{server['url']}/v1/chat/completions",
                         {**chat_body(server), **fields}, timeout=30)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    assert complete(server) == reference


def test_a_bias_json_reads_as_infinite_is_a_400_naming_its_token(server, reference):
    """1e400 is valid JSON that Python's parser reads as inf (Python's json never writes it)."""
    for bias in ("1e400", "-1e400"):
        body = json.dumps({**chat_body(server), "logit_bias": {"42": "BIAS"}}).replace(
            '"BIAS"', bias)
        response = requests.post(f"{server['url']}/v1/chat/completions", data=body, timeout=30,
                                 headers={"Content-Type": "application/json"})
        assert response.status_code == 400, response.text
        assert "inf for token 42" in response.json()["error"]["message"]
    assert complete(server) == reference


def test_output_reaching_the_model_length_is_cut_there_as_in_stock_vllm(server):
    """Prompt plus max_tokens over max_model_len (512): stock vLLM's OpenAI server lowers
    max_tokens to what is left of the context (``get_max_tokens``) and answers 200, the
    output ending with finish_reason "length"; a prompt over the context is a 400."""
    response = requests.post(f"{server['url']}/v1/completions", timeout=60, json={
        "model": server["model"], "prompt": [5] * 509, "max_tokens": 10, "temperature": 0,
        "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
    assert response.json()["choices"][0]["finish_reason"] == "length"
    response = requests.post(f"{server['url']}/v1/completions", timeout=60, json={
        "model": server["model"], "prompt": [5] * 513, "max_tokens": 10})
    assert response.status_code == 400
    assert "maximum context length is 512" in response.json()["error"]["message"]


# Requests whose constraints bar every token at a position only the step can know (a
# grammar, an overflowing penalty): answered with HTTP 400 and the reason, never a crash.
STEP_FAILURES = [
    ({"structured_outputs": {"regex": "[0-9]{3}"}, "allowed_token_ids": [5],
      "temperature": 1.0, "seed": 1}, "no token satisfies the request's constraints"),
    ({"structured_outputs": {"choice": ["yes", "no"]}, "bad_words": ["yes", "no", "y", "n"]},
     "no token satisfies the request's constraints"),
    ({"repetition_penalty": 1e-38, "temperature": 1.0, "seed": 1},
     "are not finite under the request's sampling parameters (repetition_penalty=1e-38"),
]


@pytest.mark.parametrize("fields, message", STEP_FAILURES,
                         ids=[json.dumps(f)[:60] for f, _ in STEP_FAILURES])
def test_a_request_failing_in_the_step_gets_its_reason(server, reference, fields, message):
    assert_ended_by_the_engine_with_400(server, reference, fields, message)


def assert_ended_by_the_engine_with_400(server, reference, fields, message) -> None:
    """The request with ``fields``, plain and streamed, is ended by the engine with a 400
    whose message (at most 1 KB) holds ``message``; both are counted as failed and the
    server answers as before."""
    errors = failed_requests(server["url"])
    response = post_json(f"{server['url']}/v1/chat/completions",
                         {**chat_body(server, max_tokens=16), **fields}, timeout=60)
    assert response.status_code == 400, response.text
    text = response.json()["error"]["message"]
    assert message in text and len(text.encode()) <= 1024, text
    events = []
    with requests.post(f"{server['url']}/v1/chat/completions", stream=True, timeout=60,
                       json={**chat_body(server, max_tokens=16, stream=True), **fields}
                       ) as streamed:
        assert streamed.status_code == 200
        events = [json.loads(line[6:]) for line in streamed.iter_lines()
                  if line.startswith(b"data: {")]
    assert message in events[-1]["error"]["message"] and events[-1]["error"]["code"] == 400
    wait_until_idle(server["url"], timeout=30)
    assert complete(server) == reference
    assert failed_requests(server["url"]) == errors + 2


def failed_requests(url: str) -> float:
    """vLLM's count of requests finished with an error."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{")
               and 'finished_reason="error"' in line)


# Requests whose error message, as vLLM would write it, is far longer than 1 KB: the
# plugin's option errors (10,000 unknown keys: 89 KB before the cap) and vLLM's own
# validation on the plugin's path (xgrammar refuses the regex, llguidance, tried next under
# the backend "auto", quotes all 5,000 characters of it twice).
LONG_ERRORS = [
    ({"vllm_xargs": {f"key{i}": 1 for i in range(10_000)}},
     ("unknown option(s) 'key0', 'key1', 'key10', 'key100', 'key1000' and 9995 more; "
      "valid options for policy 'focus' are")),
    ({"structured_outputs": {"regex": "[z-a]" + "a" * 5_000}}, "invalid regex"),
]


@pytest.mark.parametrize("fields, message", LONG_ERRORS,
                         ids=[json.dumps(f)[:40] for f, _ in LONG_ERRORS])
def test_error_messages_fit_in_1_kb(server, fields, message):
    response = post_json(f"{server['url']}/v1/chat/completions",
                         {**chat_body(server), **fields}, timeout=60)
    assert response.status_code == 400, response.text[:2000]
    text = response.json()["error"]["message"]
    assert len(text.encode()) <= 1024 and message in text, text


# Grammars vLLM's admission passes but its engine core cannot compile: a 400 naming the
# grammar and the backend's reason (vLLM alone: a bare 500), streamed as the error event.
# Under the backend "auto" a regex xgrammar cannot parse is admitted when llguidance can,
# but the core compiles every grammar with the backend of its first one: xgrammar here.
UNCOMPILABLE = [
    ({"structured_outputs": {"regex": "(?i)yes|no"}},
     "structured_outputs: the regex could not be compiled: RuntimeError"),
    ({"structured_outputs": {"structural_tag": json.dumps(
        {"type": "structural_tag", "format": {"type": "token", "token": 999_999}})}},
     "structured_outputs: the structural tag could not be compiled: RuntimeError"),
]


@pytest.mark.parametrize("fields, message", UNCOMPILABLE,
                         ids=[json.dumps(f)[:40] for f, _ in UNCOMPILABLE])
def test_a_grammar_the_engine_cannot_compile_is_a_400_naming_it(server, reference, fields,
                                                                 message):
    compiled = post_json(f"{server['url']}/v1/chat/completions", {
        **chat_body(server), "structured_outputs": {"regex": "[0-9]{3}"}}, timeout=60)
    assert compiled.status_code == 200, compiled.text  # the core's backend is xgrammar
    assert_ended_by_the_engine_with_400(server, reference, fields, message)


def test_bad_request_next_to_good_ones_in_one_batch(server, reference):
    def send(i):
        fields = {"vllm_xargs": {"alpha": NAN}} if i % 4 == 1 else {
            "vllm_xargs": {"threshold": 0.7}}
        return post_json(f"{server['url']}/v1/chat/completions",
                         chat_body(server, max_tokens=24, **fields), timeout=120)

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(send, range(12)))
    for i, response in enumerate(responses):
        assert response.status_code == (400 if i % 4 == 1 else 200), response.text
        if response.ok:
            assert response.json()["choices"][0]["message"]["content"] == reference


def test_abort_and_disconnect_storm_leaves_nothing_held(server, reference):
    """40 clients leave before their answers; afterwards nothing is held and the output is
    unchanged. How many of the requests the server cut short is not asserted: streamed ones
    are aborted at once, but a plain request whose client left after its generation started
    was seen to run to its end (stock vLLM 0.32 with an autoregressive model, too)."""
    def stream_then_hang_up(i):
        body = chat_body(server, max_tokens=300, stream=True,
                         vllm_xargs={"strategy": "sequential"})
        body["messages"][0]["content"] += f" number {i}"
        with requests.post(f"{server['url']}/v1/chat/completions", json=body, stream=True,
                           timeout=60) as response:
            lines = response.iter_lines()
            for _ in range(2 + i % 5):
                next(lines)
        return True

    host, port = server["url"].removeprefix("http://").split(":")

    def hang_up(i):
        """A plain request whose client leaves 0 to 150 ms after sending it, never reading
        (a raw socket: a client library's read timeout was seen to fire seconds late on a
        loaded machine, after the answer had come)."""
        body = chat_body(server, max_tokens=450, vllm_xargs={"strategy": "sequential"})
        body["messages"][0]["content"] += f" hanging up {i}"
        payload = json.dumps(body).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
        with socket.create_connection((host, int(port)), timeout=10) as connection:
            connection.sendall(head.encode() + payload)
            time.sleep(0.05 * (i % 4))

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        streams = [pool.submit(stream_then_hang_up, i) for i in range(24)]
        hang_ups = [pool.submit(hang_up, i) for i in range(16)]
        assert all(f.result() for f in streams)
        for f in hang_ups:
            f.result()
    # the plain requests vLLM does not cut short run their 450 steps first
    wait_until_idle(server["url"], timeout=180)
    assert metric(server["url"], "vllm:num_requests_waiting") == 0
    assert complete(server) == reference


def test_focus_server_reports_fewer_positions_after_eviction(server):
    positions = metric(server["url"], "vllm:diffusion_num_canvas_positions_total")
    later = metric(server["url"], "vllm:diffusion_num_positions_after_eviction_total")
    body = chat_body(server, max_tokens=48, vllm_xargs={"threshold": 0.7})
    requests.post(f"{server['url']}/v1/chat/completions", json=body, timeout=60).raise_for_status()
    positions = metric(server["url"], "vllm:diffusion_num_canvas_positions_total") - positions
    later = metric(server["url"], "vllm:diffusion_num_positions_after_eviction_total") - later
    assert 0 < later < positions
    # Streamed logprobs under FOCUS's eviction: one entry per token.
    entries = stream_logprobs(server, chat_body(server, max_tokens=20, logprobs=True,
                                                top_logprobs=1))
    assert len(entries) == 20 and all(len(e["top_logprobs"]) == 1 for e in entries)


def test_sigterm_with_streams_in_flight_ends_every_stream(dense_checkpoint, tmp_path):
    """SIGTERM under load: every open stream ends promptly (an error chunk or a closed
    connection), every unfinished plain request gets HTTP 503 "shutting down", and the
    server exits, instead of waiting for clients to give up."""
    with vllm_server_process(dense_checkpoint, "--diffusion-policy", "focus",
                             "--enforce-eager", "--max-model-len", "2048",
                             "--max-num-seqs", "8",
                             "--additional-config", json.dumps({"diffusion_block_size": 16}),
                             log_path=tmp_path / "serve.log") as (url, process):
        server = {"url": url, "model": str(dense_checkpoint)}
        started = threading.Barrier(9, timeout=60)

        def stream(i: int) -> float:
            body = chat_body(server, max_tokens=1900, stream=True,
                             vllm_xargs={"strategy": "sequential"})
            body["messages"][0]["content"] += f" {i}"
            first = True
            with contextlib.suppress(requests.RequestException):
                with requests.post(f"{url}/v1/chat/completions", json=body, stream=True,
                                   timeout=(10, 30)) as response:
                    for _ in response.iter_lines():
                        if first:
                            first = False
                            started.wait()
            return time.monotonic()

        def plain(i: int) -> requests.Response:
            # The 8 streams hold every slot (--max-num-seqs 8) for 1,900 one-token
            # steps: the plain requests wait in the queue, unfinished at the signal
            # however fast the machine.
            body = chat_body(server, max_tokens=1900, vllm_xargs={"strategy": "sequential"})
            body["messages"][0]["content"] += f" plain {i}"
            return requests.post(f"{url}/v1/chat/completions", json=body, timeout=(10, 30))

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(stream, i) for i in range(8)]
            started.wait()  # every stream holds a slot
            plains = [pool.submit(plain, i) for i in range(3)]
            time.sleep(0.5)  # the plain requests are in the engine's queue too
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            ended = [f.result() - signalled for f in futures]
            answers = [f.result() for f in plains]
        assert process.wait(timeout=30) is not None
    assert max(ended) < 10, ended
    for answer in answers:
        assert answer.status_code == 503, answer.text
        assert "shutting down" in answer.json()["error"]["message"]


def test_requests_reaching_a_shutting_down_engine_get_503(dense_checkpoint):
    """A request the HTTP server accepted just before the signal, rendered or handed to
    the engine after shutdown began, is a 503 "shutting down" (the renderer's thread pool
    is gone by then: unwrapped, that is a 500 "cannot schedule new futures after
    shutdown")."""
    import asyncio

    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.exceptions import GracefulHTTPError
    from vllm.v1.engine.async_llm import AsyncLLM

    async def after_shutdown() -> list[GracefulHTTPError]:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=str(dense_checkpoint), enforce_eager=True, max_model_len=256,
            max_num_seqs=2, additional_config={"diffusion_block_size": BLOCK_SIZE}))
        prompt = {"prompt_token_ids": [5, 6, 7]}
        async for _ in engine.generate(prompt, SamplingParams(max_tokens=4), "before"):
            pass  # the engine serves
        engine.shutdown()
        refusals = []
        for attempt in (
            engine.renderer.render_cmpl_async([{"prompt": "hello"}],
                                              engine.renderer.default_cmpl_tok_params),
            anext(engine.generate(prompt, SamplingParams(max_tokens=4), "after")),
        ):
            with pytest.raises(GracefulHTTPError) as refusal:
                await attempt
            refusals.append(refusal.value)
        return refusals

    for refusal in asyncio.run(after_shutdown()):
        assert refusal.http_status == 503
        assert "shutting down" in str(refusal)
