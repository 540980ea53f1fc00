"""Standard vs FOCUS, side by side in one run, per block size and batch size.

Workload: the model's scored evaluation prompts, greedy (``harness.scored_prompts``): on the
converted default (the default model) its definite questions, on a toy model (``--model
embedded`` or a directory) the evaluation split's task families interleaved. For each
block size (default: the model's own) and round, one engine per policy, the two policies alternating
(``harness.alternate``); for each batch size, that many requests are submitted at once
(max_num_seqs equal to the largest batch). Reported per cell: block positions computed per
committed token (layers 0-1, and after eviction: the layers FOCUS reduces), denoising
steps, output tokens/s (the median over the rounds, each round's figure kept), the
FOCUS/standard throughput ratio of the medians, and the exact-match accuracy of each
policy's answers. JSON and a PNG plot.

    python benchmarks/focus_bench.py [--model DIR|embedded] [--block-sizes 16 32]
        [--batch-sizes 8 32 64] [--threshold 0.8]
"""

from __future__ import annotations

import argparse
import functools
import pathlib

import harness

POLICIES = ("standard", "focus")


def run_cell(llm, prompts: list, max_tokens: int, options: dict) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, extra_args=options or None)
    run = harness.generate(llm, prompts, params, counters=True)
    stats = run.stats
    return {"requests": len(prompts), "output_tokens": run.output_tokens,
            "output_tokens_per_s": run.tokens_per_s,
            "block_positions_per_token_layers_0_1": stats["block_positions_per_committed_token"],
            "block_positions_per_token_later_layers":
                stats["later_layer_positions_per_committed_token"],
            "denoising_steps": stats["denoising_steps"],
            "tokens_committed_per_denoising_step": stats["tokens_committed_per_denoising_step"],
            "texts": [o.outputs[0].text for o in run.outputs]}


def median_of_rounds(rounds: list[dict]) -> dict:
    """One cell's result: the work counters of the first round (greedy decoding repeats
    them exactly) and the median throughput, with every round's throughput listed."""
    return {**rounds[0], **harness.median_of(rounds, "output_tokens_per_s",
                                             "output_tokens_per_s_rounds")}


def policy_engine(policy: str, block: int, args, model: str, options) -> dict:
    """One engine of ``policy`` through every batch size: ``{batch: cell}``."""
    from vllm_diffusion_lab.offline import diffusion_llm

    largest = max(args.batch_sizes)
    with diffusion_llm(model, diffusion_block_size=block, max_model_len=1024,
                       max_num_seqs=largest,
                       max_num_batched_tokens=max(4096, 4 * block * largest),
                       additional_config={"diffusion_policy": policy}) as llm:
        prompts = harness.scored_prompts(model, llm.get_tokenizer(), largest).prompts
        run_cell(llm, prompts[:4], args.max_tokens, options)  # warm-up
        return {batch: run_cell(llm, prompts[:batch], args.max_tokens, options)
                for batch in args.batch_sizes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_options(parser, out="results/focus_bench.json", batch_sizes=[8, 32, 64],
                               rounds=3, max_tokens=96, model_default="default")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=None,
                        help="default: the model's own")
    parser.add_argument("--threshold", type=float, default=None,
                        help="the threshold rule at this threshold (default: the model's "
                             "declared decoding defaults)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    model = harness.model_path(args)
    block_sizes = args.block_sizes or [harness.model_config(model).block_size]
    scored = harness.scored_prompts(model, AutoTokenizer.from_pretrained(model),
                                    max(args.batch_sizes))
    options = ({} if args.threshold is None
               else {"strategy": "threshold", "threshold": args.threshold})
    cells = []
    for block in block_sizes:
        measured = harness.alternate(POLICIES, args.rounds, functools.partial(
            policy_engine, block=block, args=args, model=model, options=options))
        per_batch = {p: harness.by_batch(measured[p]) for p in POLICIES}
        for batch in args.batch_sizes:
            cell = {"block_size": block, "batch_size": batch,
                    **{p: median_of_rounds(per_batch[p][batch]) for p in POLICIES}}
            cell["throughput_ratio"] = (cell["focus"]["output_tokens_per_s"]
                                        / cell["standard"]["output_tokens_per_s"])
            for policy in POLICIES:
                texts = cell[policy]["texts"]
                cell[policy]["accuracy"] = sum(
                    scored.score(i, t) for i, t in enumerate(texts)) / len(texts)
            cell["identical_outputs"] = sum(a == b for a, b in zip(
                cell["standard"].pop("texts"), cell["focus"].pop("texts")))
            cells.append(cell)
            print(f"B={block} batch={batch:>2}: later-layer positions/token "
                  f"{cell['standard']['block_positions_per_token_later_layers']:.2f} -> "
                  f"{cell['focus']['block_positions_per_token_later_layers']:.2f}, "
                  f"throughput x{cell['throughput_ratio']:.2f}")
    harness.write_report({"model": model, "options": options, "rounds": args.rounds,
                          "cells": cells}, args.out, plot)


def plot(report: dict, path: pathlib.Path) -> None:
    cells = report["cells"]
    ratios: dict[str, list] = {}
    positions: dict[str, list] = {}
    for c in cells:
        ratios.setdefault(f"B={c['block_size']}", []).append(
            (c["batch_size"], c["throughput_ratio"]))
        for policy in POLICIES:
            positions.setdefault(f"{policy} B={c['block_size']}", []).append(
                (c["batch_size"], c[policy]["block_positions_per_token_later_layers"]))
    harness.plot_panels(path, [
        harness.Panel("throughput ratio", "batch size", "FOCUS / standard", ratios,
                      reference=1.0),
        harness.Panel("later-layer positions per committed token", "batch size",
                      "positions / committed token", positions,
                      dashed=lambda label: label.startswith("standard"))])


if __name__ == "__main__":
    main()
