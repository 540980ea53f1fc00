"""SIGTERM to `vllm serve` with streaming requests in flight: do the clients get an answer?

Each run starts the server on loopback, opens ``--requests`` streaming chat requests (long
answers, so all are mid-generation), sends SIGTERM to the API server once every stream has
produced output, and records how long each client waits for its stream to end (a clean
end, an error chunk or a closed connection), whether the server exits, and whether its
whole process tree (engine core, multiprocessing's resource tracker, workers: every
descendant of the API process taken just before the signal) is gone within
``--tree-timeout`` seconds of the signal; survivors are named, then killed. A client still
waiting ``--client-timeout`` seconds after the signal counts as hung.

    python benchmarks/sigterm_under_load.py --runs 20 --policy focus
writes results/sigterm_under_load.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import signal
import subprocess
import threading
import time

import psutil
import requests

from vllm_diffusion.default_model import embedded_model_path
from vllm_diffusion_lab.fixtures.server import free_port, vllm_command

ROOT = pathlib.Path(__file__).resolve().parents[1]


def start_server(model: str, policy: str, port: int, log: pathlib.Path) -> subprocess.Popen:
    command = [vllm_command(), "serve", model, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "float32", "--enforce-eager", "--diffusion-policy", policy,
               "--max-model-len", "1024", "--max-num-seqs", "32",
               "--additional-config", json.dumps({"diffusion_block_size": 16})]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited at start-up; see {log}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).ok:
                return process
        except requests.RequestException:
            pass
        time.sleep(1)
    raise TimeoutError("server did not start")


def one_run(args: argparse.Namespace, run: int, log_dir: pathlib.Path) -> dict:
    port = free_port()
    log = log_dir / f"run{run}.log"
    process = start_server(args.model, args.policy, port, log)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    started = threading.Barrier(args.requests + 1, timeout=120)
    signalled = {}

    def client(i: int) -> dict:
        body = {"model": args.model, "stream": True, "temperature": 0, "max_tokens": 900,
                "ignore_eos": True, "vllm_xargs": {"strategy": "sequential"},
                "messages": [{"role": "user", "content": f"Tell me a long story {i}."}]}
        first = True
        outcome = "ended"
        try:
            with requests.post(url, json=body, stream=True,
                               timeout=(10, args.client_timeout)) as response:
                for line in response.iter_lines():
                    if first and line.startswith(b"data: "):
                        first = False
                        started.wait()
                    if b'"error"' in line:
                        outcome = "error chunk"
        except requests.Timeout:
            outcome = "hung"
        except requests.RequestException as err:
            outcome = f"connection closed ({type(err).__name__})"
        if first:
            started.abort()
        waited = time.monotonic() - signalled["at"] if "at" in signalled else None
        # requests reports a read timeout inside a stream as a connection error.
        if waited is not None and waited >= args.client_timeout - 1:
            outcome = "hung"
        return {"outcome": outcome, "seconds_after_signal": waited}

    with concurrent.futures.ThreadPoolExecutor(args.requests) as pool:
        futures = [pool.submit(client, i) for i in range(args.requests)]
        started.wait()  # every stream has produced output
        time.sleep(0.5)
        tree = psutil.Process(process.pid).children(recursive=True)
        signalled["at"] = time.monotonic()
        process.send_signal(signal.SIGTERM)
        results = [f.result() for f in futures]
    try:
        process.wait(timeout=60)
        exited = time.monotonic() - signalled["at"]
    except subprocess.TimeoutExpired:
        exited = None
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    tree_gone, survivors = wait_for_tree(tree, signalled["at"] + args.tree_timeout)
    hung = sum(r["outcome"] == "hung" for r in results)
    waits = [r["seconds_after_signal"] for r in results if r["seconds_after_signal"] is not None]
    summary = {"run": run, "hung_clients": hung, "server_exit_s": exited,
               "descendants": len(tree),
               "tree_gone_s": None if tree_gone is None else tree_gone - signalled["at"],
               "survivors": survivors,
               "max_client_wait_s": max(waits) if waits else None,
               "outcomes": sorted({r["outcome"] for r in results}), "log": str(log)}
    print(json.dumps(summary), flush=True)
    return summary


def wait_for_tree(tree: list[psutil.Process], deadline: float) -> tuple[float | None, list]:
    """When every process of ``tree`` has ended (``time.monotonic()``), or None and the
    survivors' command lines at ``deadline`` (then killed)."""
    while time.monotonic() < deadline:
        if not any(alive(child) for child in tree):
            return time.monotonic(), []
        time.sleep(0.1)
    survivors = [child for child in tree if alive(child)]
    names = []
    for child in survivors:
        try:
            names.append(" ".join(child.cmdline())[:200] or child.name())
            child.kill()
        except psutil.Error:
            pass
    return None, names


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(embedded_model_path()))
    parser.add_argument("--policy", default="focus")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--client-timeout", type=float, default=60.0)
    parser.add_argument("--tree-timeout", type=float, default=30.0,
                        help="seconds after the signal by which every process the server "
                             "started must be gone")
    parser.add_argument("--stop-at-first-hang", action="store_true")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "results/sigterm_under_load.json")
    args = parser.parse_args()
    log_dir = args.out.parent / "sigterm_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for run in range(args.runs):
        runs.append(one_run(args, run, log_dir))
        if args.stop_at_first_hang and runs[-1]["hung_clients"]:
            break
    report = {"policy": args.policy, "requests": args.requests, "runs": runs,
              "runs_with_hung_clients": sum(r["hung_clients"] > 0 for r in runs),
              "runs_where_server_did_not_exit": sum(r["server_exit_s"] is None for r in runs),
              "runs_with_processes_left": sum(bool(r["survivors"]) for r in runs),
              "slowest_server_exit_s": max((r["server_exit_s"] or float("inf")) for r in runs),
              "slowest_tree_exit_s": max((r["tree_gone_s"] or float("inf")) for r in runs)}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}))


if __name__ == "__main__":
    main()
