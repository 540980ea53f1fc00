"""The first requests after ``/health`` turns 200, and what a normal stop prints.

For each ``MODEL:POLICY`` pair: ``vllm serve MODEL --diffusion-policy POLICY`` (compiled,
vLLM's default), timed from launch to a healthy ``/health``; then the same greedy chat
request (``--max-tokens``) three times in a row, each timed (the first must be within 2x
of the second: the server warmed what its first requests need before reporting ready);
then a request a client got wrong (``max_tokens`` -1, a 400) and SIGINT. The server's log
is kept and searched for what a clean start and stop must not print: ERROR lines,
tracebacks, nanobind leak reports, resource-tracker warnings, the contradicting "Triton is
not installed".

    python benchmarks/first_request.py [--runs default:standard default:focus]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import time

import requests

import harness

NOISE = {"error_lines": r"\bERROR\b", "tracebacks": r"Traceback \(most recent call last\)",
         "leak_reports": r"nanobind: leaked", "resource_tracker": r"resource_tracker",
         "triton_not_installed": r"Triton is not installed"}


def timed_chat(url: str, model: str, max_tokens: int) -> float:
    body = {"model": model, "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "How can I improve my sleep?"}]}
    start = time.perf_counter()
    answer = requests.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    answer.raise_for_status()
    return time.perf_counter() - start


def run(model: str, policy: str, max_tokens: int, log: pathlib.Path) -> dict:
    from vllm_diffusion_lab.fixtures.server import vllm_server

    start = time.perf_counter()
    with vllm_server(model, "--diffusion-policy", policy, "--max-model-len", "1024",
                     startup_timeout=900, log_path=log) as url:
        ready = time.perf_counter() - start
        seconds = [timed_chat(url, model, max_tokens) for _ in range(3)]
        wrong = requests.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": model, "max_tokens": -1,
            "messages": [{"role": "user", "content": "hi"}]}).status_code
    text = log.read_text(errors="replace")
    return {"model": model, "policy": policy, "seconds_to_healthy": ready,
            "request_seconds": seconds, "first_over_second": seconds[0] / seconds[1],
            "client_error_status": wrong, "log": str(log),
            "log_noise": {name: len(re.findall(pattern, text))
                          for name, pattern in NOISE.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_options(parser, out="results/first_request.json", max_tokens=32,
                               model=False)
    parser.add_argument("--runs", nargs="+", default=["default:standard", "default:focus"],
                        help="MODEL:POLICY pairs ('default': the converted default)")
    args = parser.parse_args()
    from vllm_diffusion.default_model import default_model_path

    results = []
    for index, pair in enumerate(args.runs):
        model, policy = pair.rsplit(":", 1)
        model = str(default_model_path()) if model == "default" else model
        log = args.out.with_name(f"{args.out.stem}_{index}_{policy}.log")
        results.append(run(model, policy, args.max_tokens, log))
        print(json.dumps(results[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": "2-core CPU", "max_tokens": args.max_tokens,
                                    "runs": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
