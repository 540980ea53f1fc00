"""Compiled against eager execution of the standard policy, side by side in one run.

For each block size, two engines one after the other (``enforce_eager=True``, then
vLLM's default compilation), each timed from construction to ready (start-up, compilation
included); then, per batch size, that many chat prompts of the evaluation split submitted
at once (``ignore_eos``, fixed ``--max-tokens``, greedy), ``--rounds`` times; throughput
is the median. Reported per cell: output tokens/s of both, the compiled/eager ratio, and
whether both produced the same tokens. JSON and a PNG.

    python benchmarks/compiled_vs_eager.py [--block-sizes 4 32] [--batch-sizes 1 2 4 8 16 32]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time


def measure(llm, prompts: list[str], max_tokens: int, rounds: int) -> tuple[float, list]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    speeds, tokens = [], None
    for _ in range(rounds):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        speeds.append(sum(map(len, tokens)) / wall)
    return statistics.median(speeds), tokens


def plot(cells: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for block in sorted({c["block_size"] for c in cells}):
        rows = [c for c in cells if c["block_size"] == block]
        ax.plot([c["batch_size"] for c in rows], [c["ratio"] for c in rows], marker="o",
                label=f"B={block}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(xscale="log", xlabel="batch size", ylabel="compiled / eager output tokens/s",
           title="standard policy, compiled vs eager")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="results/compiled_vs_eager.json")
    args = parser.parse_args()

    from vllm_diffusion.default_model import default_model_path
    from vllm_diffusion_lab.offline import diffusion_llm
    from vllm_diffusion_lab.quality.corpus import mixed_eval_examples
    from vllm_diffusion_lab.quality.harness import chat_prompts

    model = str(args.model or default_model_path())
    examples = mixed_eval_examples(max(args.batch_sizes))
    cells, startups = [], []
    for block in args.block_sizes:
        measured: dict[bool, dict[int, tuple[float, list]]] = {}
        for eager in (True, False):
            start = time.perf_counter()
            with diffusion_llm(model, diffusion_block_size=block, max_model_len=1024,
                               max_num_seqs=max(args.batch_sizes),
                               enforce_eager=eager) as llm:
                startups.append({"block_size": block, "eager": eager,
                                 "startup_s": time.perf_counter() - start})
                prompts = chat_prompts(llm.get_tokenizer(), examples)
                measure(llm, prompts[:4], args.max_tokens, 1)  # warm-up
                measured[eager] = {b: measure(llm, prompts[:b], args.max_tokens, args.rounds)
                                   for b in args.batch_sizes}
        for batch in args.batch_sizes:
            (eager_speed, eager_tokens), (compiled_speed, compiled_tokens) = (
                measured[True][batch], measured[False][batch])
            cells.append({"block_size": block, "batch_size": batch,
                          "eager_tokens_per_s": eager_speed,
                          "compiled_tokens_per_s": compiled_speed,
                          "ratio": compiled_speed / eager_speed,
                          "same_tokens": eager_tokens == compiled_tokens})
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": model, "max_tokens": args.max_tokens,
                               "startup": startups, "cells": cells}, indent=2) + "\n")
    plot(cells, out.with_suffix(".png"))
    for s in startups:
        print(f"B={s['block_size']} {'eager' if s['eager'] else 'compiled'} start-up "
              f"{s['startup_s']:.1f}s")
    for c in cells:
        print(f"B={c['block_size']:>2} batch {c['batch_size']:>2}: eager "
              f"{c['eager_tokens_per_s']:.0f}, compiled {c['compiled_tokens_per_s']:.0f} tok/s "
              f"({c['ratio']:.2f}x), same tokens: {c['same_tokens']}")


if __name__ == "__main__":
    main()
