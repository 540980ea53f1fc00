"""``vllm bench serve`` against the request rate: autoregressive vs standard vs elastic.

For each configuration a ``vllm serve`` runs on loopback; ``vllm bench serve`` sends
``random``-dataset requests (``--input-len`` prompt tokens, exactly ``--output-len`` output
tokens with ``ignore_eos``, so every configuration produces the same tokens: the weights
decoded autoregressively would otherwise stop after a few tokens) at each request rate
(Poisson arrivals). The
autoregressive server is stock vLLM on the same weights (config switched to Qwen3, vLLM's
defaults, compiled); the plugin's servers run eagerly. Reported per configuration and rate:
output tokens/s and P90 TPOT; and per configuration the highest rate whose P90 TPOT stays
under the SLO. JSON and a PNG plot.

    python benchmarks/serve_vs_ar.py [--rates 1 2 4 8 16 32] [--slo-ms 100]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile

import harness


def server_args(name: str, profile: str | None) -> list[str]:
    common = ["--max-model-len", "1024", "--max-num-seqs", "64"]
    if name == "autoregressive":
        return common
    elastic = {"diffusion_block_size": 32}
    if profile is not None:  # a warm start for the latency model (optional)
        elastic["latency_profile"] = profile
    config = {"standard B=4": {"diffusion_block_size": 4}, "elastic B=32": elastic}[name]
    policy = "elastic" if name.startswith("elastic") else "standard"
    return common + ["--diffusion-policy", policy, "--additional-config", json.dumps(config)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=["1", "2", "4", "8", "16", "32"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--slo-ms", type=float, default=100.0, help="P90 TPOT objective")
    parser.add_argument("--latency-profile", default=None,
                        help="a warm start for the elastic server's latency model (optional)")
    parser.add_argument("--out-dir", type=pathlib.Path,
                        default=harness.ROOT / "results/serve_vs_ar")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # the same KV budget for every server

    from vllm_diffusion.default_model import embedded_model_path
    from vllm_diffusion_lab.bench import autoregressive_copy, run_bench_serve, write_sharegpt
    from vllm_diffusion_lab.fixtures.server import vllm_server

    if args.latency_profile:
        args.latency_profile = str(pathlib.Path(args.latency_profile).resolve())
    names = ["autoregressive", "standard B=4", "elastic B=32"]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    sharegpt = args.out_dir / "sharegpt_eval.json"
    write_sharegpt(sharegpt, args.num_prompts)
    model = pathlib.Path(embedded_model_path())
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ar_model = autoregressive_copy(model, pathlib.Path(tmp))
        for name in names:
            served = ar_model if name == "autoregressive" else model
            out = args.out_dir / name.replace(" ", "_").replace("=", "")
            out.mkdir(exist_ok=True)
            with vllm_server(served, *server_args(name, args.latency_profile),
                             log_path=out / "server.log", startup_timeout=600) as url:
                runs[name] = []
                for rate in args.rates:
                    result = run_bench_serve(
                        url, str(served), "random", rate, out, sharegpt,
                        num_prompts=args.num_prompts, input_len=args.input_len,
                        output_len=args.output_len)
                    runs[name].append(result)
                    print(json.dumps({"config": name, "rate": rate,
                                      "output_tokens_per_s": result["output_throughput"],
                                      "p90_tpot_ms": result["p90_tpot_ms"]}), flush=True)
    best = {name: max((float(r["request_rate"]) for r in rows
                       if r["p90_tpot_ms"] is not None and r["p90_tpot_ms"] < args.slo_ms),
                      default=None) for name, rows in runs.items()}
    report = {"slo_p90_tpot_ms": args.slo_ms, "highest_rate_within_slo": best, "runs": runs}
    (args.out_dir / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(runs, args, args.out_dir / "serve_vs_ar.png")
    print(json.dumps({"highest_rate_within_slo": best}))


def plot(runs: dict[str, list[dict]], args, path: pathlib.Path) -> None:
    def lines(key: str) -> dict[str, list]:
        return {name: [(float(r["request_rate"]), r[key]) for r in rows]
                for name, rows in runs.items()}

    harness.plot_panels(path, [
        harness.Panel("throughput", "request rate (req/s)", "output tokens/s",
                      lines("output_throughput")),
        harness.Panel(f"P90 TPOT (objective {args.slo_ms:g} ms)", "request rate (req/s)",
                      "ms", lines("p90_tpot_ms"), reference=args.slo_ms)], width=5)


if __name__ == "__main__":
    main()
