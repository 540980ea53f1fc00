"""Row-dropping policies against `standard`, all compiled, side by side: throughput and the
row-layers each computes, so a policy's speed-up can be read against its ideal.

For one block size, each policy (same strategy and threshold: `threshold`, 0.8 by
default) runs in its own engine at vLLM's default compilation, the policies alternating
within each of ``--rounds`` rounds (``harness.alternate``); every batch size submits that
many requests at once, each generating exactly ``--max-tokens`` tokens (``ignore_eos``),
and tokens/s is the median over the rounds. Row-layers per committed token: every row each
layer computed (prefill and block commits through every layer, block positions through the
layers they reached), from the engine's counters. A policy's ideal speed-up over
`standard` is the ratio of the two row-layer figures; "of ideal" is the measured speed-up
over it. JSON and a PNG.

``--shape embedded``: the model (``--model``) with chat prompts of the evaluation split.
``--shape large``: a compute-bound random SDAR (12 layers, hidden 768; written to
``results/large-random-sdar``) with random 64-token prompts.

    python benchmarks/compiled_hooks.py --shape large --batch-sizes 8 --rounds 3
    python benchmarks/compiled_hooks.py --batch-sizes 16 32 64 --rounds 3
"""

from __future__ import annotations

import argparse
import pathlib
import time

import harness
from throughput_vs_ar import LARGE_MODEL, LARGE_SHAPE, large_workload


def row_layers_per_token(stats: dict, num_layers: int) -> float:
    """Rows times layers computed per committed token."""
    block = sum(stats["block_positions_per_layer"])
    other = stats["positions_computed"] - stats["block_positions_computed"]
    return (block + other * num_layers) / max(stats["tokens_committed"], 1)


def workload(shape: str, llm, count: int) -> list:
    from vllm_diffusion_lab.quality.corpus import eval_examples
    from vllm_diffusion_lab.quality.harness import chat_prompts

    if shape == "embedded":
        prompts = chat_prompts(llm.get_tokenizer(), eval_examples(20))
        return [prompts[i % len(prompts)] for i in range(count)]
    return large_workload(llm.llm_engine.vllm_config.model_config.hf_config.vocab_size, count)


def policy_engine(policy: str, args, model, options: dict) -> dict:
    """One engine of ``policy``: its start-up (the first compiled forward with hooks
    included) and per batch size its tokens/s and row-layers per committed token."""
    from vllm import SamplingParams

    from vllm_diffusion_lab.offline import diffusion_llm

    def params(max_tokens: int):
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                              extra_args=options)

    start = time.perf_counter()
    with diffusion_llm(model, diffusion_block_size=args.block_size, max_model_len=1024,
                       max_num_seqs=max(args.batch_sizes), enforce_eager=args.eager,
                       additional_config={"diffusion_policy": policy}) as llm:
        num_layers = llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers
        prompts = workload(args.shape, llm, max(args.batch_sizes))
        # the first forward with hooks compiles the pieces: a warm-up request
        llm.generate(prompts[:2], params(args.block_size), use_tqdm=False)
        result = {"startup_s": time.perf_counter() - start}
        for batch in args.batch_sizes:
            run = harness.generate(llm, prompts[:batch], params(args.max_tokens), counters=True)
            result[batch] = {"tokens_per_s": run.tokens_per_s,
                             "row_layers": row_layers_per_token(run.stats, num_layers)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_options(parser, out="results/compiled_hooks.json",
                               batch_sizes=[16, 32, 64], rounds=3, max_tokens=64)
    parser.add_argument("--shape", choices=("embedded", "large"), default="embedded")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--policies", nargs="+", default=["standard", "focus", "es"])
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument("--eager", action="store_true", help="every engine eager")
    args = parser.parse_args()

    if args.shape == "large":
        from vllm_diffusion_lab.fixtures.tiny_sdar import build_tiny_sdar

        model = (LARGE_MODEL if (LARGE_MODEL / "config.json").exists()
                 else build_tiny_sdar(LARGE_MODEL, **LARGE_SHAPE))
    else:
        model = harness.model_path(args)
    options = {"strategy": "threshold", "threshold": args.threshold}
    measured = harness.alternate(args.policies, args.rounds,
                                 lambda policy: policy_engine(policy, args, model, options))
    rows = []
    for batch in args.batch_sizes:
        cells = {p: [r[batch] for r in measured[p]] for p in args.policies}
        base = harness.median_of(cells["standard"], "tokens_per_s")["tokens_per_s"]
        base_work = cells["standard"][-1]["row_layers"]
        for policy in args.policies:
            speed = harness.median_of(cells[policy], "tokens_per_s")
            work = cells[policy][-1]["row_layers"]
            speedup, ideal = speed["tokens_per_s"] / base, base_work / work
            rows.append({"policy": policy, "batch_size": batch, **speed,
                         "row_layers_per_token": work, "speedup": speedup,
                         "ideal_speedup": ideal, "of_ideal": speedup / ideal})
    startup = {p: [r["startup_s"] for r in measured[p]] for p in args.policies}
    report = {"shape": args.shape, "block_size": args.block_size, "options": options,
              "rounds": args.rounds, "eager": args.eager, "max_tokens": args.max_tokens,
              "startup_s": startup, "rows": rows}
    harness.write_report(report, args.out, plot)
    print("| policy | batch | tokens/s | row-layers / token | / standard | ideal | of ideal |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['batch_size']} | {r['tokens_per_s']:.0f} | "
              f"{r['row_layers_per_token']:.1f} | {r['speedup']:.2f} | {r['ideal_speedup']:.2f} | "
              f"{r['of_ideal']:.2f} |")
    print("start-up with the first compiled forward (s):",
          {p: [round(t, 1) for t in ts] for p, ts in startup.items()})


def plot(report: dict, path: pathlib.Path) -> None:
    lines: dict[str, list] = {}
    for r in report["rows"]:
        lines.setdefault(r["policy"], []).append((r["batch_size"], r["speedup"]))
    harness.plot_panels(path, [harness.Panel(
        f"{report['shape']}, block {report['block_size']}", "batch size",
        "tokens/s over standard's", lines, reference=1.0)])


if __name__ == "__main__":
    main()
