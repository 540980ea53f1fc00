"""Standard vs FOCUS, side by side in one run, per block size and batch size.

Workload: chat-formatted prompts from the evaluation split, the task families interleaved
(a ShareGPT-like mix of short questions with answers of 10-60 tokens), greedy. For each
block size and round, one engine per policy, the two policies alternating; for each batch
size, that many requests are submitted at once (max_num_seqs equal to the largest batch).
Reported per cell: block positions computed per committed token (layers 0-1, and after
eviction: the layers FOCUS reduces), denoising steps, output tokens/s (the median over the
rounds, each round's figure kept), the FOCUS/standard throughput ratio of the medians, and
the exact-match accuracy of each policy's answers.
JSON and a PNG plot.

    python benchmarks/focus_bench.py [--model DIR] [--block-sizes 16 32 64] [--batch-sizes 8 32 64]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

POLICIES = ("standard", "focus")


def run_cell(llm, prompts: list[str], max_tokens: int, options: dict) -> dict:
    from vllm import SamplingParams

    from vllm_diffusion_lab.offline import stats_delta

    params = SamplingParams(temperature=0, max_tokens=max_tokens, extra_args=options or None)
    before = llm.collective_rpc("diffusion_stats")[0]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    stats = stats_delta(before, llm.collective_rpc("diffusion_stats")[0])
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"requests": len(prompts), "output_tokens": tokens, "wall_time_s": round(wall, 3),
            "output_tokens_per_s": tokens / wall,
            "block_positions_per_token_layers_0_1": stats["block_positions_per_committed_token"],
            "block_positions_per_token_later_layers":
                stats["later_layer_positions_per_committed_token"],
            "denoising_steps": stats["denoising_steps"],
            "tokens_committed_per_denoising_step": stats["tokens_committed_per_denoising_step"],
            "texts": [o.outputs[0].text for o in outputs]}


def median_of_rounds(rounds: list[dict]) -> dict:
    """One cell's result: the work counters of the first round (greedy decoding repeats
    them exactly) and the median throughput, with every round's throughput listed."""
    cell = dict(rounds[0])
    speeds = [r["output_tokens_per_s"] for r in rounds]
    cell["output_tokens_per_s"] = statistics.median(speeds)
    cell["output_tokens_per_s_rounds"] = speeds
    cell.pop("wall_time_s")
    return cell


def plot(cells: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for block in sorted({c["block_size"] for c in cells}):
        rows = [c for c in cells if c["block_size"] == block]
        batches = [c["batch_size"] for c in rows]
        left.plot(batches, [c["throughput_ratio"] for c in rows], marker="o", label=f"B={block}")
        for policy, style in zip(POLICIES, ("--", "-")):
            right.plot(batches, [c[policy]["block_positions_per_token_later_layers"] for c in rows],
                       style, marker="o", label=f"{policy} B={block}")
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.set(xlabel="batch size", ylabel="FOCUS / standard", title="throughput ratio")
    right.set(xlabel="batch size", ylabel="positions / committed token",
              title="later-layer positions per committed token")
    left.legend()
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument("--rounds", type=int, default=3,
                        help="engine pairs per block size; throughput is their median")
    parser.add_argument("--out", default="results/focus_bench.json")
    args = parser.parse_args()

    from vllm_diffusion.default_model import default_model_path
    from vllm_diffusion_lab.offline import diffusion_llm
    from vllm_diffusion_lab.quality.corpus import mixed_eval_examples, score
    from vllm_diffusion_lab.quality.harness import chat_prompts

    model = str(args.model or default_model_path())
    examples = mixed_eval_examples(max(args.batch_sizes))
    options = {"strategy": "threshold", "threshold": args.threshold}
    rounds: dict[tuple[int, int, str], list[dict]] = {}
    for block in args.block_sizes:
        for _ in range(args.rounds):
            for policy in POLICIES:
                with diffusion_llm(model, diffusion_block_size=block, max_model_len=1024,
                                   max_num_seqs=max(args.batch_sizes),
                                   max_num_batched_tokens=max(4096, 4 * block * max(args.batch_sizes)),
                                   additional_config={"diffusion_policy": policy}) as llm:
                    prompts = chat_prompts(llm.get_tokenizer(), examples)
                    run_cell(llm, prompts[:4], args.max_tokens, options)  # warm-up
                    for batch in args.batch_sizes:
                        rounds.setdefault((block, batch, policy), []).append(
                            run_cell(llm, prompts[:batch], args.max_tokens, options))
    cells = []
    for block in args.block_sizes:
        for batch in args.batch_sizes:
            cell = {"block_size": block, "batch_size": batch,
                    **{p: median_of_rounds(rounds[block, batch, p]) for p in POLICIES}}
            cell["throughput_ratio"] = (cell["focus"]["output_tokens_per_s"]
                                        / cell["standard"]["output_tokens_per_s"])
            for policy in POLICIES:
                texts = cell[policy]["texts"]
                cell[policy]["accuracy"] = sum(
                    score(e.family, e.answer, t) for e, t in zip(examples, texts)) / len(texts)
            cell["identical_outputs"] = sum(a == b for a, b in zip(
                cell["standard"].pop("texts"), cell["focus"].pop("texts")))
            cells.append(cell)
            print(f"B={block:>2} batch={batch:>2}: later-layer positions/token "
                  f"{cell['standard']['block_positions_per_token_later_layers']:.2f} -> "
                  f"{cell['focus']['block_positions_per_token_later_layers']:.2f}, "
                  f"throughput x{cell['throughput_ratio']:.2f}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": model, "options": options, "rounds": args.rounds,
                               "cells": cells}, indent=2) + "\n")
    plot(cells, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
