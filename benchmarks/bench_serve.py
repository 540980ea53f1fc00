"""``vllm bench serve`` against the plugin at a few request rates.

Starts ``vllm serve`` on loopback with the chosen model and policy, runs ``vllm bench
serve`` with the ``random`` dataset and with a local ShareGPT-format JSON file (written
from the evaluation split), stops the server, and writes every result (JSON) plus a plot
(PNG) of output throughput and P90 TPOT against the request rate.

    python benchmarks/bench_serve.py [--model DIR] [--rates 1 4 16] [--num-prompts 32]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import harness

DATASETS = ("random", "sharegpt")


def plot(summary: list[dict], path: pathlib.Path, title: str) -> None:
    def lines(key: str) -> dict[str, list]:
        return {dataset: [(float(r["request_rate"]), r[key]) for r in summary
                          if r["dataset"] == dataset] for dataset in DATASETS}

    harness.plot_panels(path, [
        harness.Panel(f"throughput, {title}", "request rate (req/s)", "output tokens/s",
                      lines("output_throughput")),
        harness.Panel("P90 TPOT", "request rate (req/s)", "ms", lines("p90_tpot_ms"))],
        width=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--policy", default="standard")
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--rates", nargs="+", default=["1", "4", "16"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--out-dir", default="results/bench_serve")
    args = parser.parse_args()

    from vllm_diffusion.default_model import default_model_path
    from vllm_diffusion_lab.bench import run_bench_serve, write_sharegpt
    from vllm_diffusion_lab.fixtures.server import vllm_server

    model = args.model or str(default_model_path())
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sharegpt = out_dir / "sharegpt_eval.json"
    write_sharegpt(sharegpt, args.num_prompts)
    summary = []
    with vllm_server(model, "--diffusion-policy", args.policy, "--enforce-eager",
                     "--additional-config", json.dumps({"diffusion_block_size": args.block_size}),
                     "--max-model-len", "1024", "--max-num-seqs", str(args.max_num_seqs),
                     log_path=out_dir / "server.log") as url:
        for dataset in DATASETS:
            for rate in args.rates:
                summary.append(run_bench_serve(
                    url, model, dataset, rate, out_dir, sharegpt, num_prompts=args.num_prompts,
                    input_len=args.input_len, output_len=args.output_len))
                print(json.dumps({k: summary[-1][k] for k in (
                    "dataset", "request_rate", "completed", "output_throughput", "p90_tpot_ms")}))
    report = {"model": model, "policy": args.policy, "block_size": args.block_size,
              "num_prompts": args.num_prompts, "runs": summary}
    (out_dir / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(summary, out_dir / "throughput_tpot.png",
         f"{pathlib.Path(model).name}, {args.policy}, block {args.block_size}")
    print(f"wrote {out_dir / 'summary.json'} and {out_dir / 'throughput_tpot.png'}")


if __name__ == "__main__":
    main()
