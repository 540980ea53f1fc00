"""Fast-dLLM's caches on the embedded full-attention model: ``recompute`` (LLaDA's
published loop), ``prefix`` and ``dual`` (``diffusion_cache_mode``), each with one token
per step and with Fast-dLLM's threshold decoding (0.9).

Each cache mode is one engine (the option is engine-wide), started once per round, the
modes alternating over ``--rounds``; in it both decoding rules run at each batch size b:
b chat requests (the evaluation families interleaved) submitted at once, repeated until
``--min-requests`` ran, greedy, ``max_tokens`` the canvas (``--canvas``), block
``--block`` (32), ending at the first stop token. Reported per (mode, rule, batch):
tokens/s (median over rounds), the speed-up over ``recompute`` and over ``dual`` with the
same rule, rows and row-layers computed per committed token, KV refreshes per request,
and exact-match accuracy on these prompts (the paired accuracy on 60 problems per family
comes from the quality harness, see RESULTS.md). JSON and a PNG.

    python benchmarks/fast_dllm_cache.py [--batch-sizes 1 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics

import harness

MODES = ("recompute", "prefix", "dual")
RULES = {"one per step": {"strategy": "low_confidence_static"},
         "threshold 0.9": {"strategy": "threshold", "threshold": 0.9}}


def measure(llm, prompts, examples, batch: int, min_requests: int, max_tokens: int,
            options: dict, layers: int) -> dict:
    from vllm import SamplingParams

    from vllm_diffusion_lab.quality.corpus import score

    tokens = rows = refreshes = correct = done = 0
    seconds = 0.0
    while done < max(min_requests, batch):
        indices = [(done + i) % len(prompts) for i in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, extra_args=options)
        run = harness.generate(llm, [prompts[i] for i in indices], params, counters=True)
        seconds += run.seconds
        for index, out in zip(indices, run.outputs):
            example = examples[index]
            correct += score(example.family, example.answer, out.outputs[0].text)
        rows += run.stats["positions_computed"]
        refreshes += run.stats["kv_refreshes"]
        tokens += run.output_tokens
        done += batch
    return {"tokens_per_s": tokens / seconds, "output_tokens": tokens,
            "rows_per_committed_token": rows / max(tokens, 1),
            "row_layers_per_committed_token": rows * layers / max(tokens, 1),
            "refreshes_per_request": refreshes / done, "accuracy": correct / done}


def run_mode(mode: str, args, examples) -> dict[tuple[str, int], dict]:
    import json

    from vllm_diffusion_lab.offline import diffusion_llm
    from vllm_diffusion_lab.quality.harness import chat_prompts

    layers = json.loads((pathlib.Path(args.llada) / "config.json").read_text())["n_layers"]
    results = {}
    with diffusion_llm(args.llada, diffusion_block_size=args.block, max_model_len=1024,
                       max_num_seqs=max(args.batch_sizes), enforce_eager=False,
                       additional_config={"diffusion_cache_mode": mode,
                                          "diffusion_canvas_tokens": args.canvas}) as llm:
        prompts = chat_prompts(llm.get_tokenizer(), examples)
        measure(llm, prompts, examples, 1, 1, 8, {}, layers)  # warm-up
        for rule, options in RULES.items():
            for batch in args.batch_sizes:
                results[rule, batch] = measure(llm, prompts, examples, batch,
                                               args.min_requests, args.canvas, options, layers)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_options(parser, out="results/fast_dllm_cache.json",
                               batch_sizes=[1, 8], rounds=3, model=False)
    parser.add_argument("--llada", default=str(harness.ROOT / "checkpoints/llada-small-chat"))
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--canvas", type=int, default=256)
    parser.add_argument("--min-requests", type=int, default=8)
    args = parser.parse_args()
    harness.engines_in_process()

    from vllm_diffusion_lab.quality.corpus import mixed_eval_examples

    examples = mixed_eval_examples(max(args.batch_sizes + [args.min_requests]))
    measured = harness.alternate(MODES, args.rounds, lambda mode: run_mode(mode, args,
                                                                          examples))
    median = {(mode, rule, batch): statistics.median(r[rule, batch]["tokens_per_s"]
                                                     for r in rounds)
              for mode, rounds in measured.items() for rule, batch in rounds[0]}
    rows = []
    for (mode, rule, batch), tps in median.items():
        runs = [r[rule, batch] for r in measured[mode]]
        rows.append({"mode": mode, "rule": rule, "batch_size": batch,
                     "tokens_per_s": tps,
                     "tokens_per_s_each_round": [r["tokens_per_s"] for r in runs],
                     "speedup_over_recompute": harness.ratio(
                         tps, median["recompute", rule, batch]),
                     "speedup_over_dual": harness.ratio(tps, median["dual", rule, batch]),
                     **{key: statistics.mean(r[key] for r in runs) for key in (
                         "output_tokens", "rows_per_committed_token",
                         "row_layers_per_committed_token", "refreshes_per_request",
                         "accuracy")}})
    report = {"machine": f"{os.cpu_count()} CPU cores", "llada": args.llada,
              "block": args.block, "canvas": args.canvas, "rounds": args.rounds,
              "min_requests": args.min_requests, "rows": rows,
              "package": harness.package_files()}
    harness.write_report(report, args.out, plot)
    print("| mode | rule | batch | tokens/s | / recompute | / dual | rows / token | "
          "refreshes / request | accuracy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['rule']} | {r['batch_size']} | {r['tokens_per_s']:.1f} | "
              f"{r['speedup_over_recompute']:.2f} | {r['speedup_over_dual']:.2f} | "
              f"{r['rows_per_committed_token']:.1f} | {r['refreshes_per_request']:.1f} | "
              f"{r['accuracy']:.2f} |")


def plot(report: dict, path: pathlib.Path) -> None:
    speed: dict[str, list] = {}
    rows: dict[str, list] = {}
    for r in report["rows"]:
        label = f"{r['mode']}, {r['rule']}"
        speed.setdefault(label, []).append((r["batch_size"], r["tokens_per_s"]))
        rows.setdefault(label, []).append((r["batch_size"], r["rows_per_committed_token"]))
    dashed = lambda label: label.endswith("one per step")  # noqa: E731
    harness.plot_panels(path, [
        harness.Panel(f"Output tokens/s ({report['machine']})", "batch size", "tokens/s",
                      speed, dashed=dashed),
        harness.Panel("Rows computed per committed token", "batch size", "rows / token",
                      rows, dashed=dashed)])


if __name__ == "__main__":
    main()
