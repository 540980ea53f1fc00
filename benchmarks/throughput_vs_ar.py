"""Output tokens/s against batch size: stock vLLM decoding the same weights autoregressively
next to the plugin's configurations, in one run.

The autoregressive baseline is what every user already has, served by stock vLLM with its
defaults: for the converted default (``--model default``) the original SmolLM2-135M-
Instruct, for an embedded checkpoint the same weights with its config switched to
``Qwen3ForCausalLM`` (``harness.autoregressive_counterpart``).
Both sides are compiled by default (``--ar-eager`` / ``--plugin-eager`` for eager; FOCUS
still runs eagerly, as it drops rows inside the forward), each engine in this one process,
one at a time, the configurations alternating in each of ``--rounds`` rounds
(``harness.alternate``).

Equal work (the default; ``--natural-lengths`` to let both stop at EOS): the
autoregressive side generates, per request, exactly as many tokens as the plugin
configuration it is compared with did (``ignore_eos`` with that request's length), since
its outputs from these weights are noise of another length. Each plugin configuration
thus has its own autoregressive row ("autoregressive as <config>"), run in the same round
on the same prompts. For batch size b, b greedy chat requests (the evaluation families
interleaved) are submitted at once, repeated until at least ``--min-requests`` have run;
tokens/s is total output tokens over wall time, the median over rounds. Reported next to
it: the ratio to autoregressive, exact-match accuracy on all prompts of the run, and rows
computed per committed token (prompt prefill and block commits included; for
autoregressive decoding, prompt plus output tokens per output token). JSON and a PNG plot.
``--prompt-set chat`` runs chat prompts of other kinds instead of the evaluation split's
(``vllm_diffusion_lab.quality.chat_set``, not scored); ``--ignore-eos`` makes the plugin
generate ``--max-tokens`` per request too (fixed lengths: the positions after its EOS are
decoded as well, so this measures the engine, not the answers).

``--shape large`` runs the fixed configurations on a compute-bound shape instead: a
random-weight SDAR of 12 layers, hidden 768 (12 query / 4 KV heads of 64), written to
``results/large-random-sdar`` (so ``tools/profile_latency.py --model`` can time its steps),
with random 64-token prompts and exactly 64 output tokens per request (``ignore_eos``).
Random weights commit about one token per step, so these figures show the cost side (rows
and time per step), not diffusion's parallelism.

    python benchmarks/throughput_vs_ar.py [--batch-sizes 1 2 4 8 16 32 64] [--rounds 2]
        [--latency-profile results/latency.json]  # a warm start for elastic (optional)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import tempfile
import time

import harness

# name: (diffusion block size, None: the model's own; engine additional_config; per-request
# options); None: AR
CONFIGS = {
    "autoregressive": None,
    # at the model's own block size and decoding defaults (the converted default: block 8)
    "standard": (None, {"diffusion_policy": "standard"}, {}),
    "focus": (None, {"diffusion_policy": "focus"}, {}),
    "elastic": (None, {"diffusion_policy": "elastic"}, {}),
    "chunk 2, reuse": (None, {"diffusion_policy": "standard"},
                       {"chunk_size": 2, "chunk_reuse": True}),
    "chunk 4, reuse": (None, {"diffusion_policy": "standard"},
                       {"chunk_size": 4, "chunk_reuse": True}),
    "whole block, reuse": (None, {"diffusion_policy": "standard"}, {"chunk_reuse": True}),
    "standard B=4": (4, {"diffusion_policy": "standard"}, {}),
    # the embedded model's own default threshold is 0.7 (its config.json); 0.9 is the
    # published SDAR loop's and the engine's
    "standard B=4, threshold 0.9": (4, {"diffusion_policy": "standard"}, {"threshold": 0.9}),
    "standard B=4, threshold 0.8": (4, {"diffusion_policy": "standard"}, {"threshold": 0.8}),
    "standard B=4, threshold 0.7": (4, {"diffusion_policy": "standard"}, {"threshold": 0.7}),
    "standard B=8": (8, {"diffusion_policy": "standard"}, {}),
    "standard B=16": (16, {"diffusion_policy": "standard"}, {}),
    "standard B=32": (32, {"diffusion_policy": "standard"}, {}),
    "focus B=32": (32, {"diffusion_policy": "focus"}, {}),
    "chunk 4 of B=32": (32, {"diffusion_policy": "standard"}, {"chunk_size": 4}),
    "chunk 8 of B=32": (32, {"diffusion_policy": "standard"}, {"chunk_size": 8}),
    "chunk 4 of B=32, reuse": (32, {"diffusion_policy": "standard"},
                               {"chunk_size": 4, "chunk_reuse": True}),
    "chunk 8 of B=32, reuse": (32, {"diffusion_policy": "standard"},
                               {"chunk_size": 8, "chunk_reuse": True}),
    "chunk 16 of B=32, reuse": (32, {"diffusion_policy": "standard"},
                                {"chunk_size": 16, "chunk_reuse": True}),
    # no options: the latency model is learned from the steps (--latency-profile: a
    # warm start)
    "elastic B=32": (32, {"diffusion_policy": "elastic"}, {}),
    "elastic B=32, exact": (32, {"diffusion_policy": "elastic"}, {"chunk_reuse": False}),
}
ELASTIC = [name for name, config in CONFIGS.items()
           if config is not None and config[1]["diffusion_policy"] == "elastic"]
AR_AS = "autoregressive as "  # the autoregressive row of a plugin configuration

LARGE_SHAPE = {"num_layers": 12, "hidden_size": 768, "num_heads": 12, "num_kv_heads": 4,
               "head_dim": 64, "block_size": 32}
LARGE_MODEL = harness.ROOT / "results/large-random-sdar"
LARGE_CONFIGS = ["autoregressive", "standard B=4", "standard B=16", "standard B=32",
                 "focus B=32", "chunk 4 of B=32, reuse", "chunk 8 of B=32, reuse"]


def large_workload(vocab_size: int, count: int, length: int = 64) -> list:
    """Random ``length``-token prompts (ids clear of the tiny tokenizer's special tokens)."""
    import random

    from vllm.inputs import TokensPrompt

    rng = random.Random(0)
    return [TokensPrompt(prompt_token_ids=[rng.randrange(16, vocab_size)
                                           for _ in range(length)]) for _ in range(count)]


def open_engine(name: str, model, ar_model, args):
    from vllm_diffusion_lab.offline import autoregressive_llm, diffusion_llm

    if CONFIGS[name] is None:
        return autoregressive_llm(ar_model, max_num_seqs=max(args.batch_sizes),
                                  enforce_eager=args.ar_eager)
    block, engine, _ = CONFIGS[name]
    return diffusion_llm(model, diffusion_block_size=block, max_model_len=1024,
                         max_num_seqs=max(args.batch_sizes), additional_config=engine,
                         enforce_eager=args.plugin_eager)


def run_batch(llm, name: str, prompts: list, examples, batch: int, min_requests: int,
              max_tokens: int, lengths: list[int] | None = None,
              ignore_eos: bool = False) -> dict:
    """``lengths``: the autoregressive side's exact output length per request (equal work),
    in submission order; the result's ``lengths`` are this run's, for the next side."""
    from vllm import SamplingParams

    from vllm_diffusion_lab.offline import stats_delta
    from vllm_diffusion_lab.quality.corpus import score

    diffusion = CONFIGS[name] is not None
    options = CONFIGS[name][2] if diffusion else {}
    # the plugin stops at EOS (unless --ignore-eos); the AR side takes its lengths
    natural = examples is not None and lengths is None and not ignore_eos
    scored = natural and bool(examples[0].answer)  # the chat set has no answers
    params = SamplingParams(temperature=0, max_tokens=max_tokens, extra_args=options or None,
                            ignore_eos=not natural)
    before = harness.diffusion_counters(llm) if diffusion else None
    tokens = prompt_tokens = correct = done = 0
    produced: list[int] = []
    start = time.perf_counter()
    while done < max(min_requests, batch):
        indices = [(done + i) % len(prompts) for i in range(batch)]
        chunk_params = params if lengths is None else [
            SamplingParams(temperature=0, max_tokens=max(lengths[done + i], 1), ignore_eos=True)
            for i in range(batch)]
        outputs = llm.generate([prompts[i] for i in indices], chunk_params, use_tqdm=False)
        for index, out in zip(indices, outputs):
            produced.append(len(out.outputs[0].token_ids))
            tokens += produced[-1]
            prompt_tokens += len(out.prompt_token_ids)
            if scored:
                example = examples[index]
                correct += score(example.family, example.answer, out.outputs[0].text)
        done += batch
    wall = time.perf_counter() - start
    if diffusion:
        rows = stats_delta(before, harness.diffusion_counters(llm))[
            "all_positions_per_committed_token"]
    else:
        rows = (prompt_tokens + tokens) / max(tokens, 1)
    return {"tokens_per_s": tokens / wall, "requests": done, "output_tokens": tokens,
            "accuracy": correct / done if scored else None, "lengths": produced,
            "rows_per_committed_token": rows, "seconds": wall}


def measure_config(name: str, args, model, ar_model, examples, workload,
                   recorded: dict) -> dict[str, dict[int, dict]]:
    """One configuration's engine through every batch size: ``{row: {batch: result}}``.
    A plugin configuration records its lengths in ``recorded``; the autoregressive engine
    (after them in the round) runs one row per plugin configuration on those lengths."""
    from vllm_diffusion_lab.quality.harness import chat_prompts

    plugin = [n for n in args.configs if CONFIGS[n] is not None]
    rows: dict[str, dict[int, dict]] = {}
    with open_engine(name, model, ar_model, args) as llm:
        prompts = (workload if workload is not None
                   else chat_prompts(llm.get_tokenizer(), examples))
        run_batch(llm, name, prompts, examples, 1, 1, 8)  # warm-up
        targets = [None] if CONFIGS[name] is not None or args.natural_lengths else plugin
        for target in targets:
            row = name if target is None else AR_AS + target
            for batch in args.batch_sizes:
                lengths = None if target is None else recorded[target][batch]
                result = run_batch(llm, name, prompts, examples, batch, args.min_requests,
                                   args.max_tokens, lengths, args.ignore_eos)
                lengths = result.pop("lengths")
                if target is None and CONFIGS[name] is not None:
                    recorded.setdefault(name, {})[batch] = lengths
                rows.setdefault(row, {})[batch] = result
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_options(parser, out="results/throughput_vs_ar.json",
                               batch_sizes=[1, 2, 4, 8, 16, 32, 64], rounds=2, max_tokens=96)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--min-requests", type=int, default=16)
    harness.add_prompt_set_option(parser)
    parser.add_argument("--ignore-eos", action="store_true",
                        help="the plugin generates max_tokens per request too (fixed "
                             "lengths, not scored); default: it stops at EOS")
    parser.add_argument("--ar-eager", action="store_true")
    parser.add_argument("--plugin-eager", action="store_true",
                        help="the plugin's engines eager (default: vLLM's compilation)")
    parser.add_argument("--natural-lengths", action="store_true",
                        help="both sides stop at EOS or max_tokens (default: equal work)")
    parser.add_argument("--shape", choices=("embedded", "large"), default="embedded",
                        help="the model (--model), or the compute-bound random-weight shape")
    parser.add_argument("--latency-profile", default=None,
                        help="tools/profile_latency.py output to warm-start the elastic "
                             "configurations' latency model (optional)")
    args = parser.parse_args()
    if args.shape == "large":
        args.configs = [c for c in args.configs if c in LARGE_CONFIGS]
        args.max_tokens = 64
    if args.latency_profile is not None:
        for name in ELASTIC:
            CONFIGS[name][1]["latency_profile"] = args.latency_profile
    harness.engines_in_process()

    count = max(args.batch_sizes + [args.min_requests])
    with tempfile.TemporaryDirectory() as tmp:
        if args.shape == "large":
            from vllm_diffusion_lab.fixtures.tiny_sdar import build_tiny_sdar

            model = build_tiny_sdar(LARGE_MODEL, **LARGE_SHAPE)  # kept for profiling
            vocab = json.loads((model / "config.json").read_text())["vocab_size"]
            examples, workload = None, large_workload(vocab, count)
        else:
            model = harness.model_path(args)
            examples, workload = harness.workload_examples(args, count), None
        ar_model = harness.autoregressive_counterpart(pathlib.Path(model), pathlib.Path(tmp))
        # the plugin configurations first in each round: the autoregressive rows take
        # their lengths
        order = sorted(args.configs, key=lambda n: CONFIGS[n] is None)
        recorded: dict[str, dict[int, list[int]]] = {}
        measured = harness.alternate(order, args.rounds, lambda name: measure_config(
            name, args, model, ar_model, examples, workload, recorded))
    cells: dict[str, dict[int, list[dict]]] = {}
    for rounds in measured.values():
        for rows in rounds:
            for row, by_batch in rows.items():
                for batch, result in by_batch.items():
                    cells.setdefault(row, {}).setdefault(batch, []).append(result)
    report = {**summarise(cells, args), "model": str(model), "package": harness.package_files()}
    harness.write_report(report, args.out, plot)
    print_table(report)


def summarise(cells, args) -> dict:
    def median_tps(name: str, batch: int) -> float | None:
        runs = cells.get(name, {}).get(batch)
        return statistics.median(r["tokens_per_s"] for r in runs) if runs else None

    rows = []
    for name, by_batch in cells.items():
        for batch, runs in by_batch.items():
            ar = None
            if CONFIGS.get(name, ()) is not None and not name.startswith(AR_AS):
                ar = median_tps("autoregressive" if args.natural_lengths else AR_AS + name,
                                batch)
            rows.append({**harness.speed_row(name, batch, runs, ar),
                         "accuracy": (None if runs[0]["accuracy"] is None
                                      else statistics.mean(r["accuracy"] for r in runs))})
    return {"machine": f"{os.cpu_count()} CPU cores", "shape": args.shape,
            "equal_work": not args.natural_lengths, "ar_compiled": not args.ar_eager,
            "plugin_compiled": not args.plugin_eager, "max_tokens": args.max_tokens,
            "prompt_set": args.prompt_set, "ignore_eos": args.ignore_eos,
            "rounds": args.rounds, "rows": rows}


def print_table(report: dict) -> None:
    print("| config | batch | tokens/s | / AR | accuracy | rows / token |")
    print("|---|---|---|---|---|---|")
    for r in report["rows"]:
        ratio = r["ratio_to_autoregressive"]
        accuracy = "-" if r["accuracy"] is None else f"{r['accuracy']:.2f}"
        print(f"| {r['config']} | {r['batch_size']} | {r['tokens_per_s']:.0f} | "
              f"{'-' if ratio is None else f'{ratio:.2f}'} | {accuracy} | "
              f"{r['rows_per_committed_token']:.2f} |")


def plot(report: dict, path: pathlib.Path) -> None:
    lines: dict[str, list] = {}
    for r in report["rows"]:
        lines.setdefault(r["config"], []).append((r["batch_size"], r["tokens_per_s"]))
    harness.plot_panels(path, [harness.Panel(
        f"Output throughput vs batch size ({report['machine']})",
        "batch size (concurrent requests)", "output tokens/s", lines,
        dashed=lambda label: label.startswith("autoregressive"))], width=7)


if __name__ == "__main__":
    main()
