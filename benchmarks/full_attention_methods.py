"""Fast-dLLM's caches and the seed methods on the embedded full-attention model, as their
papers' tables set them: ``recompute`` (LLaDA's published loop), ``prefix`` and ``dual``
(``diffusion_cache_mode``), each with one token per step and with Fast-dLLM's threshold
decoding (0.9); and on ``dual``, Sparse-dLLM (``sparse_prefix``), ES-dLLM (``es``), both
with the same two rules, and Ada-DLM (``ada``: its freeze rule, as published and with the
0.9 threshold's freezes added).

Each configuration is one engine (cache mode and policy are engine-wide), started once per
round, the configurations alternating over ``--rounds``; in it each decoding rule runs at
each batch size b: b chat requests (the evaluation families interleaved) submitted at
once, repeated until ``--min-requests`` ran, greedy, ``max_tokens`` the canvas
(``--canvas``), block ``--block`` (32), ending at the first stop token. Reported per
(configuration, rule, batch): tokens/s (median over rounds), the speed-up over
``recompute`` and over ``dual`` with the rule it is compared with (its own; Ada-DLM's: the
threshold rule), rows and row-layers computed per committed token (ES-dLLM's skipped rows
leave the later layers: row-layers counts what each layer computed), KV refreshes per
request and exact-match accuracy on these prompts (the paired accuracy on 60 problems per
family comes from the quality harness, see RESULTS.md).

``--long-prompt N`` (0 to skip; default 2048): ``dual`` and Sparse-dLLM on ``dual`` again at
batch 1 with each prompt preceded by filler stories to N tokens, ``--long-requests`` of
them, each decoding the whole canvas (``ignore_eos``: equal work; the model does not answer
at that length): tokens/s, and the keys each block row reads per layer on a step after the
selection (the block's context positions, or the kept ones, plus the block). JSON and a
PNG.

``--shape large``: instead of the embedded model, a larger random LLaDA built in code
(``LARGE_LLADA``: 12 layers, d 768, 12 heads, MLP 2048, written to
``results/large-random-llada``; compute-bound at batch 8, at batch 1 bound by reading its
weights) with random 64-token prompts (and random long prompts),
every request decoding the whole canvas (``ignore_eos``), one token per step only (how
many tokens a threshold commits depends on a trained model's confidences): speed on equal
work, no accuracy (its weights answer nothing), Ada-DLM not run (its freezing needs a
model whose predictions converge).

``--equal-work``: the chat requests, too, decode the whole canvas (``ignore_eos``), as
LLaDA's published loop fills its generation length: every configuration decodes the same
positions, and a method whose answers end sooner is not charged for it (to the first stop
token, tokens/s falls with shorter answers: a request's block refreshes cost the same
however few tokens it keeps).

    python benchmarks/full_attention_methods.py [--batch-sizes 1 8] [--rounds 3]
    python benchmarks/full_attention_methods.py --shape large --canvas 128
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import statistics

import harness
from throughput_vs_ar import large_workload

ONE_PER_STEP = {"strategy": "low_confidence_static"}
THRESHOLD = {"strategy": "threshold", "threshold": 0.9}
RULES = {"one per step": ONE_PER_STEP, "threshold 0.9": THRESHOLD}
ADA_RULES = {"freeze": {}, "freeze + threshold 0.9": {"static_threshold": 0.9}}
DUAL = {"diffusion_cache_mode": "dual"}
# configuration -> (engine options, {rule: request options}, the rule it is compared with)
CONFIGS = {
    "recompute": ({"diffusion_cache_mode": "recompute"}, RULES),
    "prefix": ({"diffusion_cache_mode": "prefix"}, RULES),
    "dual": (DUAL, RULES),
    "dual + Sparse-dLLM": ({**DUAL, "diffusion_policy": "sparse_prefix"}, RULES),
    "dual + ES-dLLM": ({**DUAL, "diffusion_policy": "es"}, RULES),
    "dual + Ada-DLM": ({**DUAL, "diffusion_policy": "ada"}, ADA_RULES),
}
LONG = ("dual", "dual + Sparse-dLLM")
LARGE_LLADA = {"num_layers": 12, "hidden_size": 768, "num_heads": 12, "num_kv_heads": 12,
               "mlp_hidden_size": 2048, "max_sequence_length": 4096}
LARGE_MODEL = harness.ROOT / "results/large-random-llada"


def baseline_rule(rule: str) -> str:
    """The decoding rule of ``recompute`` / ``dual`` a rule is compared with."""
    return rule if rule in RULES else "threshold 0.9"


def measure(llm, prompts, examples, batch: int, min_requests: int, max_tokens: int,
            options: dict, layers: int, ignore_eos: bool = False) -> dict:
    from vllm import SamplingParams

    from vllm_diffusion_lab.quality.corpus import score

    tokens = rows = row_layers = refreshes = correct = done = 0
    seconds = 0.0
    while done < max(min_requests, batch):
        indices = [(done + i) % len(prompts) for i in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, extra_args=options,
                                ignore_eos=ignore_eos)
        run = harness.generate(llm, [prompts[i] for i in indices], params, counters=True)
        seconds += run.seconds
        if examples is not None:
            for index, out in zip(indices, run.outputs):
                example = examples[index]
                correct += score(example.family, example.answer, out.outputs[0].text)
        stats = run.stats
        rows += stats["positions_computed"]
        # rows outside the block go through every layer; block rows as each layer counted
        row_layers += ((stats["positions_computed"] - stats["block_positions_computed"])
                       * layers + sum(stats["block_positions_per_layer"]))
        refreshes += stats["kv_refreshes"]
        tokens += run.output_tokens
        done += batch
    return {"tokens_per_s": tokens / seconds, "output_tokens": tokens,
            "rows_per_committed_token": rows / max(tokens, 1),
            "row_layers_per_committed_token": row_layers / max(tokens, 1),
            "refreshes_per_request": refreshes / done,
            "accuracy": correct / done if examples is not None else None}


def long_prompts(tokenizer, examples, length: int) -> list[str]:
    """Each example's chat prompt with filler stories before its question, to ``length``
    tokens or just over."""
    import random

    from vllm_diffusion_lab.quality.corpus import filler_story

    rng, prompts = random.Random(0), []
    for example in examples:
        filler = ""
        while True:
            text = f"{filler}\n\n{example.prompt}" if filler else example.prompt
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                   tokenize=False, add_generation_prompt=True)
            if len(tokenizer.encode(prompt)) >= length:
                break
            filler += " " + filler_story(rng)
        prompts.append(prompt)
    return prompts


def run_config(name: str, args, examples) -> dict[tuple[str, int], dict]:
    import json

    from vllm_diffusion_lab.offline import diffusion_llm
    from vllm_diffusion_lab.quality.harness import chat_prompts

    config = json.loads((pathlib.Path(args.llada) / "config.json").read_text())
    layers, large = config["n_layers"], args.shape == "large"
    engine, rules = CONFIGS[name]
    if large:  # random weights' confidences say nothing of a trained model's: equal steps
        rules = {"one per step": ONE_PER_STEP}
    results = {}
    long = args.long_prompt and name in LONG
    with diffusion_llm(args.llada, diffusion_block_size=args.block,
                       max_model_len=args.long_prompt + 2 * args.canvas if long else 1024,
                       max_num_seqs=max(args.batch_sizes), enforce_eager=False,
                       additional_config={**engine,
                                          "diffusion_canvas_tokens": args.canvas}) as llm:
        tokenizer = llm.get_tokenizer()
        if large:
            count = max(args.batch_sizes + [args.min_requests, args.long_requests])
            prompts = large_workload(config["vocab_size"], count)
        else:
            prompts = chat_prompts(tokenizer, examples)
        measure(llm, prompts, examples, 1, 1, 8, {}, layers)  # warm-up
        for rule, options in (() if args.long_only else rules.items()):
            for batch in args.batch_sizes:
                results[rule, batch] = measure(llm, prompts, examples, batch,
                                               args.min_requests, args.canvas, options, layers,
                                               ignore_eos=large or args.equal_work)
        if long:  # equal work: the whole canvas for every request (accuracy is not the point)
            prompts = (large_workload(config["vocab_size"], args.long_requests,
                                      args.long_prompt) if large
                       else long_prompts(tokenizer, examples, args.long_prompt))
            for rule, options in rules.items():
                results[f"long, {rule}", 1] = {
                    **measure(llm, prompts, examples, 1, args.long_requests, args.canvas,
                              options, layers, ignore_eos=True),
                    "prompt_tokens": args.long_prompt if large else statistics.mean(
                        len(tokenizer.encode(p)) for p in prompts[:args.long_requests])}
    return results


def keys_read(prompt: float, canvas: int, block: int, ratio: float | None) -> float:
    """Keys a block row reads per layer on a dual-cache step: every position (prompt and
    canvas), or (Sparse-dLLM, keep ratio ``ratio``) the kept context positions plus the
    block."""
    context = prompt + canvas - block
    return context + block if ratio is None else math.floor(ratio * context) + block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_options(parser, out="results/full_attention_methods.json",
                               batch_sizes=[1, 8], rounds=3, model=False)
    parser.add_argument("--llada", default=str(harness.ROOT / "checkpoints/llada-small-chat"))
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--canvas", type=int, default=256)
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--long-prompt", type=int, default=2048)
    parser.add_argument("--long-requests", type=int, default=2)
    parser.add_argument("--long-only", action="store_true",
                        help="only the long-prompt measurements (of the configurations in LONG)")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS),
                        help="default: all (all but Ada-DLM with --shape large)")
    parser.add_argument("--equal-work", action="store_true",
                        help="every request decodes the whole canvas (ignore_eos), as "
                             "LLaDA's published loop fills its generation length")
    parser.add_argument("--shape", choices=("embedded", "large"), default="embedded",
                        help="large: a larger random LLaDA, compute-bound at batch 8 "
                             "(--llada is ignored)")
    args = parser.parse_args()
    harness.engines_in_process()

    from vllm_diffusion_lab.quality.corpus import mixed_eval_examples

    examples = None
    if args.configs is None:
        args.configs = [name for name in CONFIGS
                        if args.shape == "embedded" or name != "dual + Ada-DLM"]
    if args.shape == "large":
        if "dual + Ada-DLM" in args.configs:
            parser.error("--shape large: Ada-DLM freezes converged predictions, which random "
                         "weights do not make; leave it out of --configs")
        from vllm_diffusion_lab.fixtures.tiny_llada import build_tiny_llada

        args.llada = str(build_tiny_llada(LARGE_MODEL, **LARGE_LLADA))
    else:
        examples = mixed_eval_examples(max(args.batch_sizes + [args.min_requests]))
    measured = harness.alternate(args.configs, args.rounds,
                                 lambda name: run_config(name, args, examples))
    median = {(name, rule, batch): statistics.median(r[rule, batch]["tokens_per_s"]
                                                     for r in rounds)
              for name, rounds in measured.items() for rule, batch in rounds[0]}
    rows = []
    for (name, rule, batch), tps in median.items():
        runs = [r[rule, batch] for r in measured[name]]
        long = rule.startswith("long, ")
        compared = ("long, " if long else "") + baseline_rule(rule.removeprefix("long, "))
        row = {"config": name, "rule": rule, "batch_size": batch, "tokens_per_s": tps,
               "tokens_per_s_each_round": [r["tokens_per_s"] for r in runs],
               "compared_with_rule": compared,
               "speedup_over_recompute": harness.ratio(
                   tps, median.get(("recompute", compared, batch))),
               "speedup_over_dual": harness.ratio(tps, median.get(("dual", compared, batch))),
               **{key: statistics.mean(r[key] for r in runs) for key in (
                   "output_tokens", "rows_per_committed_token",
                   "row_layers_per_committed_token", "refreshes_per_request")},
               "accuracy": (None if runs[0]["accuracy"] is None
                            else statistics.mean(r["accuracy"] for r in runs))}
        if long:
            row["prompt_tokens"] = runs[0]["prompt_tokens"]
            row["keys_read_per_block_row_layer"] = keys_read(
                row["prompt_tokens"], args.canvas, args.block,
                0.5 if "Sparse" in name else None)
        rows.append(row)
    report = {"machine": f"{os.cpu_count()} CPU cores", "shape": args.shape,
              "equal_work": args.equal_work or args.shape == "large",
              "llada": args.llada,
              "block": args.block, "canvas": args.canvas, "rounds": args.rounds,
              "min_requests": args.min_requests, "long_prompt": args.long_prompt,
              "rows": rows, "package": harness.package_files()}
    harness.write_report(report, args.out, plot)
    print("| configuration | rule | batch | tokens/s | / recompute | / dual | rows / token | "
          "row-layers / token | refreshes / request | accuracy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['rule']} | {r['batch_size']} | {r['tokens_per_s']:.1f} | "
              f"{show(r['speedup_over_recompute'])} | {show(r['speedup_over_dual'])} | "
              f"{r['rows_per_committed_token']:.1f} | "
              f"{r['row_layers_per_committed_token']:.0f} | "
              f"{r['refreshes_per_request']:.1f} | {show(r['accuracy'])} |")


def show(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot(report: dict, path: pathlib.Path) -> None:
    speed: dict[str, list] = {}
    rows: dict[str, list] = {}
    for r in report["rows"]:
        if r["rule"].startswith("long, "):
            continue
        label = f"{r['config']}, {r['rule']}"
        speed.setdefault(label, []).append((r["batch_size"], r["tokens_per_s"]))
        rows.setdefault(label, []).append((r["batch_size"],
                                           r["row_layers_per_committed_token"]))
    dashed = lambda label: label.endswith("one per step")  # noqa: E731
    harness.plot_panels(path, [
        harness.Panel(f"Output tokens/s ({report['machine']})", "batch size", "tokens/s",
                      speed, dashed=dashed),
        harness.Panel("Row-layers computed per committed token", "batch size",
                      "row-layers / token", rows, dashed=dashed)])


if __name__ == "__main__":
    main()
