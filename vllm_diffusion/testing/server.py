"""Start and stop a real ``vllm serve`` on loopback for tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import requests


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_command() -> str:
    """The ``vllm`` console script of the running interpreter's environment."""
    candidate = pathlib.Path(sys.executable).parent / "vllm"
    if not candidate.exists():
        raise FileNotFoundError(f"no vllm command next to {sys.executable}; run tools/setup_env.sh")
    return str(candidate)


@contextlib.contextmanager
def vllm_server(model: str | pathlib.Path, *args: str, startup_timeout: float = 180.0,
                log_path: str | pathlib.Path | None = None) -> Iterator[str]:
    """Run ``vllm serve MODEL ARGS`` on a free loopback port; yields its base URL.

    On exit the server gets SIGINT and must stop within 60 s (else it is killed and the
    exit raises).
    """
    with vllm_server_process(model, *args, startup_timeout=startup_timeout,
                             log_path=log_path) as (url, _):
        yield url


@contextlib.contextmanager
def vllm_server_process(model: str | pathlib.Path, *args: str, startup_timeout: float = 180.0,
                        log_path: str | pathlib.Path | None = None
                        ) -> Iterator[tuple[str, subprocess.Popen]]:
    """``vllm_server`` that also yields the API server's process (for its resource use)."""
    port = free_port()
    command = [vllm_command(), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "float32", *args]
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {process.returncode} at start-up "
                                   f"(log: {log_path})")
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve did not become healthy in {startup_timeout}s")
            time.sleep(1)
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                raise RuntimeError("vllm serve did not shut down within 60 s of SIGINT")
        if log_path:
            log.close()
