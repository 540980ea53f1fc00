"""Bounded soak of `vllm serve` with mixed traffic and faults, on loopback.

Concurrent clients send, until ``--minutes`` have passed, a seeded mix of:
good chat and completion requests (streamed and not, greedy and sampled), requests with bad
options or sampling values (each must be a 400), streams the client hangs up mid-answer,
and requests the client abandons by timing out. A fixed greedy reference request is
repeated throughout and must always get the same answer. Afterwards the server must hold
no request and no KV page. The server's memory (RSS of the API process and the engine
core, summed) is sampled over time.

    python benchmarks/soak.py --minutes 10 --policy focus
writes results/soak.json and results/soak.png. "failed" counts every outcome that is not
the expected one for its kind (a 5xx, an exception, a 200 for bad input, a changed
reference answer).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import pathlib
import random
import re
import statistics
import threading
import time

import psutil
import requests

from vllm_diffusion.default_model import embedded_model_path
from vllm_diffusion_lab.fixtures.server import vllm_server_process

ROOT = pathlib.Path(__file__).resolve().parents[1]

NAN = float("nan")
BAD_FIELDS = [
    {"vllm_xargs": {"alpha": NAN}}, {"vllm_xargs": {"threshold": "nan"}},
    {"vllm_xargs": {"alpha": float("inf")}}, {"vllm_xargs": {"unknown": 1}},
    {"vllm_xargs": {"pool_kernel": 4}}, {"temperature": NAN}, {"top_p": NAN},
    {"seed": 2**70}, {"presence_penalty": 1.0}, {"max_tokens": -5},
    {"n": 2, "temperature": 1.0, "vllm_xargs": {"return_step_map": True}},
]
KINDS = ("chat", "chat_stream", "completion_sampled", "bad_input", "hang_up", "time_out",
         "reference")
WEIGHTS = (30, 20, 10, 15, 10, 5, 10)
TOPICS = ["the river", "a red fox", "numbers", "the moon", "a small town", "bread"]


def post(url: str, body: dict, **kwargs) -> requests.Response:
    """POST with NaN written as the JSON literal (requests' json= refuses it)."""
    return requests.post(url, data=json.dumps(body), headers={"Content-Type":
                                                              "application/json"}, **kwargs)


class Soak:
    def __init__(self, url: str, model: str, seed: int) -> None:
        self.url, self.model = url, model
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.sent = collections.Counter()
        self.completed = collections.Counter()
        self.failed = collections.Counter()
        self.failures: list[str] = []
        self.reference: str | None = None

    def chat_body(self, i: int, **extra) -> dict:
        return {"model": self.model, "temperature": 0, "max_tokens": 48,
                "messages": [{"role": "user", "content": f"Tell me about {TOPICS[i % 6]}."}],
                **extra}

    def reference_answer(self) -> str:
        response = post(f"{self.url}/v1/chat/completions", {
            "model": self.model, "temperature": 0, "max_tokens": 32, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Start with 12, add 7, then subtract 4."}]},
            timeout=120)
        response.raise_for_status()
        return response.json()["choices"][0]["message"]["content"]

    def one(self, kind: str, i: int) -> None:
        chat = f"{self.url}/v1/chat/completions"
        if kind == "chat":
            ok = post(chat, self.chat_body(i), timeout=120).status_code == 200
        elif kind == "chat_stream":
            with post(chat, self.chat_body(i, stream=True), stream=True, timeout=120) as r:
                events = [line for line in r.iter_lines() if line]  # blank lines part events
            ok = r.status_code == 200 and events[-1] == b"data: [DONE]"
        elif kind == "completion_sampled":
            r = post(f"{self.url}/v1/completions", {
                "model": self.model, "prompt": f"Once upon a time {i}", "max_tokens": 40,
                "temperature": 0.8, "top_p": 0.9, "seed": i}, timeout=120)
            ok = r.status_code == 200
        elif kind == "bad_input":
            r = post(chat, {**self.chat_body(i), **BAD_FIELDS[i % len(BAD_FIELDS)]}, timeout=60)
            ok = r.status_code == 400
        elif kind == "hang_up":
            with post(chat, self.chat_body(i, stream=True, max_tokens=400, ignore_eos=True),
                      stream=True, timeout=120) as r:
                lines = r.iter_lines()
                for _ in range(3):
                    next(lines)
            ok = r.status_code == 200
        elif kind == "time_out":
            try:
                post(chat, self.chat_body(i, max_tokens=400, ignore_eos=True), timeout=0.5)
                ok = True  # answered within the timeout: fine too
            except requests.Timeout:
                ok = True
        elif kind == "reference":
            ok = self.reference_answer() == self.reference
        else:
            raise AssertionError(kind)
        if not ok:
            raise RuntimeError(f"{kind}: unexpected outcome")

    def run_one(self, i: int) -> None:
        with self.lock:
            kind = self.rng.choices(KINDS, WEIGHTS)[0]
            self.sent[kind] += 1
        try:
            self.one(kind, i)
        except Exception as err:  # noqa: BLE001 - every failure is counted and reported
            with self.lock:
                self.failed[kind] += 1
                self.failures.append(f"{kind}: {type(err).__name__}: {err}"[:300])
            return
        with self.lock:
            self.completed[kind] += 1


def metric(url: str, name: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    values = re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.MULTILINE)
    return sum(float(v) for v in values)


def server_rss(process: psutil.Process) -> dict[str, float]:
    """MiB resident per server process (API server, engine core, worker) and in all."""
    by_process: dict[str, float] = {}
    for p in [process, *process.children(recursive=True)]:
        try:
            name = "api_server" if p.pid == process.pid else p.name()
            by_process[name] = by_process.get(name, 0.0) + p.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            pass
    return {**by_process, "total": sum(by_process.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(embedded_model_path()))
    parser.add_argument("--policy", default="focus")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--sample-seconds", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "results/soak.json")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = args.out.with_suffix(".server.log")
    with vllm_server_process(args.model, "--diffusion-policy", args.policy, "--enforce-eager",
                             "--max-model-len", "1024", "--max-num-seqs", "16",
                             "--additional-config", json.dumps({"diffusion_block_size": 16}),
                             log_path=log) as (url, popen):
        soak = Soak(url, args.model, args.seed)
        soak.reference = soak.reference_answer()
        server = psutil.Process(popen.pid)
        rss: list[tuple[float, float]] = []
        rss_by_process: list[tuple[float, dict[str, float]]] = []
        start = time.monotonic()
        deadline = start + args.minutes * 60
        counter = iter(range(10**9))

        def client() -> None:
            while time.monotonic() < deadline:
                soak.run_one(next(counter))

        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            clients = [pool.submit(client) for _ in range(args.concurrency)]
            last_report = start
            while not all(c.done() for c in clients):
                now = time.monotonic()
                sample = server_rss(server)
                rss.append((now - start, sample["total"]))
                rss_by_process.append((now - start, sample))
                if now - last_report >= 60:
                    last_report = now
                    print(f"{(now - start) / 60:5.1f} min  sent {sum(soak.sent.values())}  "
                          f"failed {sum(soak.failed.values())}  rss {rss[-1][1]:.0f} MiB",
                          flush=True)
                time.sleep(args.sample_seconds)
            for c in clients:
                c.result()
        # Idle: nothing running or waiting, no KV page held.
        idle_deadline = time.monotonic() + 60
        while time.monotonic() < idle_deadline:
            leaked = {name: metric(url, f"vllm:{name}") for name in
                      ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}
            if not any(leaked.values()):
                break
            time.sleep(1)
        reference_after = soak.reference_answer()
        rss.append((time.monotonic() - start, server_rss(server)["total"]))
    minute = max(1, int(60 / args.sample_seconds))
    # The first minute is warm-up (allocator pools, caches); growth is judged after it.
    warm = [r for t, r in rss if t >= 60] or [r for _, r in rss]
    first, last = warm[:minute], warm[-minute:]
    half = [(t, r) for t, r in rss if t >= rss[-1][0] / 2]
    report = {
        "policy": args.policy, "minutes": args.minutes, "concurrency": args.concurrency,
        "model": args.model,
        "sent": sum(soak.sent.values()), "completed": sum(soak.completed.values()),
        "failed": sum(soak.failed.values()),
        "by_kind": {k: {"sent": soak.sent[k], "completed": soak.completed[k],
                        "failed": soak.failed[k]} for k in KINDS},
        "failures": soak.failures[:50],
        "leaked_after": leaked,
        "reference_unchanged_after": reference_after == soak.reference,
        "rss_mib": {"second_minute_median": statistics.median(first),
                    "last_minute_median": statistics.median(last),
                    "max": max(r for _, r in rss),
                    "growth_percent": 100 * (statistics.median(last) / statistics.median(first)
                                             - 1),
                    "second_half_mib_per_minute": 60 * (half[-1][1] - half[0][1])
                    / max(half[-1][0] - half[0][0], 1e-9)},
        "rss_samples": rss,
        "rss_samples_by_process": rss_by_process,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in report.items()
                      if k not in ("rss_samples", "rss_samples_by_process", "failures")},
                     indent=1))


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times, values = zip(*report["rss_samples"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([t / 60 for t in times], values)
    ax.set_xlabel("minutes")
    ax.set_ylabel("server RSS (MiB, API + engine)")
    ax.set_ylim(0, max(values) * 1.15)
    ax.set_title(f"soak, {report['policy']}: {report['sent']} requests, "
                 f"{report['failed']} failed, RSS {report['rss_mib']['growth_percent']:+.1f}%")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
