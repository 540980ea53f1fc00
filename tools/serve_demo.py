"""The README's main job: serve the default model (SmolLM2-135M-Instruct converted to block
diffusion, built by ``tools/setup_env.sh``) and answer a chat request.

Starts ``vllm serve <default model> --diffusion-policy standard`` on loopback, streams a
chat completion (printing the final tokens as they arrive), shows the diffusion counters
from ``/metrics``, and stops the server. ``--keep`` leaves it running until Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import time

import requests

from vllm_diffusion.default_model import default_model_path
from vllm_diffusion_lab.fixtures.server import vllm_server

QUESTION = "What is the capital of Australia, and what is the city known for?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--policy", default="standard")
    parser.add_argument("--keep", action="store_true", help="keep serving until Ctrl-C")
    args = parser.parse_args()
    model = str(args.model or default_model_path())
    print(f"starting: vllm serve {model} --diffusion-policy {args.policy}", flush=True)
    with vllm_server(model, "--diffusion-policy", args.policy, "--enforce-eager",
                     "--max-model-len", "1024", log_path="serve_demo.log") as url:
        print(f"serving at {url} (log: serve_demo.log)\nuser: {QUESTION}\nassistant: ",
              end="", flush=True)
        body = {"model": model, "temperature": 0, "max_tokens": 96, "stream": True,
                "messages": [{"role": "user", "content": QUESTION}]}
        start, chunks = time.perf_counter(), 0
        with requests.post(f"{url}/v1/chat/completions", json=body, stream=True,
                           timeout=120) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                    if delta:
                        chunks += 1
                        print(delta, end="", flush=True)
        print(f"\n[{chunks} streamed chunks in {time.perf_counter() - start:.2f}s]")
        metrics = requests.get(f"{url}/metrics", timeout=10).text
        for line in metrics.splitlines():
            if line.startswith("vllm:diffusion_") and "_total" in line \
                    and 'layer="' not in line:  # the per-layer counters: 30 lines here
                print(line)
        if args.keep:
            print("serving; Ctrl-C to stop")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass


if __name__ == "__main__":
    main()
