"""Compiled against eager execution of the standard policy, side by side in one run.

For each block size, two engines, eager (``enforce_eager=True``) and at vLLM's default
compilation, alternating in each of ``--rounds`` rounds (``harness.alternate``), each
timed from construction to ready (start-up, compilation included); then, per batch size,
that many chat prompts of the evaluation split submitted at once (``ignore_eos``, fixed
``--max-tokens``, greedy). Throughput is the median over the rounds. Reported per cell:
output tokens/s of both, the compiled/eager ratio, and whether both produced the same
tokens; per engine its start-up in each round. JSON and a PNG.

    python benchmarks/compiled_vs_eager.py [--block-sizes 4 32] [--batch-sizes 1 2 4 8 16 32]
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import time

import harness

MODES = {"eager": True, "compiled": False}  # name: enforce_eager


def mode_engine(mode: str, block: int, args, model: str, examples) -> dict:
    from vllm import SamplingParams

    from vllm_diffusion_lab.offline import diffusion_llm
    from vllm_diffusion_lab.quality.harness import chat_prompts

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    with diffusion_llm(model, diffusion_block_size=block, max_model_len=1024,
                       max_num_seqs=max(args.batch_sizes), enforce_eager=MODES[mode]) as llm:
        result = {"startup_s": time.perf_counter() - start}
        prompts = chat_prompts(llm.get_tokenizer(), examples)
        llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
        for batch in args.batch_sizes:
            run = harness.generate(llm, prompts[:batch], params)
            result[batch] = {"tokens_per_s": run.tokens_per_s, "tokens": run.token_ids()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_options(parser, out="results/compiled_vs_eager.json",
                               batch_sizes=[1, 2, 4, 8, 16, 32], rounds=3, max_tokens=64)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[4, 32])
    args = parser.parse_args()

    from vllm_diffusion_lab.quality.corpus import mixed_eval_examples

    model = harness.model_path(args)
    examples = mixed_eval_examples(max(args.batch_sizes))
    cells, startups = [], []
    for block in args.block_sizes:
        measured = harness.alternate(list(MODES), args.rounds, functools.partial(
            mode_engine, block=block, args=args, model=model, examples=examples))
        for mode, eager in MODES.items():
            startups.append({"block_size": block, "eager": eager,
                             **harness.median_of(measured[mode], "startup_s")})
        for batch in args.batch_sizes:
            speed = {mode: harness.median_of([r[batch] for r in measured[mode]], "tokens_per_s")
                     for mode in MODES}
            cells.append({"block_size": block, "batch_size": batch,
                          "eager_tokens_per_s": speed["eager"]["tokens_per_s"],
                          "compiled_tokens_per_s": speed["compiled"]["tokens_per_s"],
                          "ratio": (speed["compiled"]["tokens_per_s"]
                                    / speed["eager"]["tokens_per_s"]),
                          "same_tokens": all(e[batch]["tokens"] == c[batch]["tokens"]
                                             for e, c in zip(measured["eager"],
                                                             measured["compiled"]))})
    harness.write_report({"model": model, "max_tokens": args.max_tokens, "rounds": args.rounds,
                          "startup": startups, "cells": cells}, args.out, plot)
    for s in startups:
        rounds = ", ".join(f"{t:.1f}" for t in s["startup_s_each_round"])
        print(f"B={s['block_size']} {'eager' if s['eager'] else 'compiled'} start-up "
              f"{s['startup_s']:.1f}s (rounds: {rounds})")
    for c in cells:
        print(f"B={c['block_size']:>2} batch {c['batch_size']:>2}: eager "
              f"{c['eager_tokens_per_s']:.0f}, compiled {c['compiled_tokens_per_s']:.0f} tok/s "
              f"({c['ratio']:.2f}x), same tokens: {c['same_tokens']}")


def plot(report: dict, path: pathlib.Path) -> None:
    lines: dict[str, list] = {}
    for c in report["cells"]:
        lines.setdefault(f"B={c['block_size']}", []).append((c["batch_size"], c["ratio"]))
    harness.plot_panels(path, [harness.Panel(
        "standard policy, compiled vs eager", "batch size",
        "compiled / eager output tokens/s", lines, reference=1.0)])


if __name__ == "__main__":
    main()
