"""Every registered decoding policy side by side in one run: accuracy and work.

For each block size, one engine per policy (each with its own default options, the
papers' settings; ``elastic`` with a latency profile of this machine, made first by
``tools/profile_latency.py`` unless given), max_num_seqs = the batch size, and the
evaluation split (``--per-family`` problems of every task family, chat template, greedy)
submitted at once. Reported per policy and block: exact-match accuracy per family with
95% Wilson intervals, tokens committed per denoising step, block positions through each
layer per committed token (and grouped into runs of layers with the same count), all rows
per committed token (prefill and commits included), output tokens/s and its ratio to
``standard`` at the same block size. ``--rounds`` > 1 repeats every engine, alternating
the policies, and reports the median throughput. JSON and a PNG.

    python benchmarks/policy_comparison.py [--model DIR] [--block-sizes 16 32]
        [--batch-size 32] [--per-family 60]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def wilson(successes: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion."""
    if total == 0:
        return 0.0, 0.0
    p = successes / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return max(0.0, centre - half), min(1.0, centre + half)


def layer_groups(per_layer: list[float]) -> list[dict]:
    """Runs of consecutive layers with the same positions per committed token."""
    groups: list[dict] = []
    for layer, value in enumerate(per_layer):
        if groups and abs(groups[-1]["positions_per_token"] - value) < 1e-9:
            groups[-1]["layers"][1] = layer
        else:
            groups.append({"layers": [layer, layer], "positions_per_token": value})
    return groups


def run_policy(llm, examples: list, max_tokens: int) -> dict:
    """The quality harness's evaluation (after a warm-up), with 95% intervals, the mean
    accuracy over families, throughput and the per-layer work grouped."""
    from vllm import SamplingParams

    from vllm_diffusion_lab.quality.harness import chat_prompts, evaluate

    warm_up = chat_prompts(llm.get_tokenizer(), examples[:4])
    llm.generate(warm_up, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    result = evaluate(llm, examples, {}, max_tokens)
    per_layer = result["layer_positions_per_committed_token"]
    return {
        **{k: result[k] for k in ("accuracy", "output_tokens",
                                  "tokens_committed_per_denoising_step",
                                  "layer_positions_per_committed_token",
                                  "all_positions_per_committed_token",
                                  "denoising_steps_per_block")},
        "accuracy_95ci": {f: wilson(*counts) for f, counts in result["correct"].items()},
        "mean_accuracy": sum(result["accuracy"].values()) / len(result["accuracy"]),
        "output_tokens_per_s": result["output_tokens"] / result["wall_time_s"],
        "layer_groups": layer_groups(per_layer),
    }


def ensure_latency_profile(model: str, block: int, path: pathlib.Path) -> pathlib.Path:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(ROOT / "tools" / "profile_latency.py"), "--model",
                        model, "--block-size", str(block), "--out", str(path)], check=True)
    return path


def plot(results: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = sorted({r["block_size"] for r in results})
    fig, axes = plt.subplots(1, 1 + len(blocks), figsize=(5 * (1 + len(blocks)), 4))
    for block, marker in zip(blocks, "os^D"):
        for r in (r for r in results if r["block_size"] == block):
            axes[0].scatter(r["throughput_ratio"], r["mean_accuracy"], marker=marker)
            axes[0].annotate(f"{r['policy']} B={block}", (r["throughput_ratio"],
                                                           r["mean_accuracy"]), fontsize=7)
    axes[0].axvline(1.0, color="grey", linewidth=0.8)
    axes[0].set(xlabel="throughput / standard", ylabel="mean accuracy over families",
                title="accuracy vs speed")
    for ax, block in zip(axes[1:], blocks):
        for r in (r for r in results if r["block_size"] == block):
            ax.plot(r["layer_positions_per_committed_token"], marker=".", label=r["policy"])
        ax.set(xlabel="layer", ylabel="block positions / committed token",
               title=f"work per layer, B={block}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--policies", nargs="+", default=None, help="default: all registered")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--per-family", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--latency-profile", type=pathlib.Path, default=None)
    parser.add_argument("--out", default="results/policy_comparison.json")
    args = parser.parse_args()

    from vllm_diffusion.default_model import default_model_path
    from vllm_diffusion.policies import POLICIES
    from vllm_diffusion_lab.offline import diffusion_llm
    from vllm_diffusion_lab.quality.corpus import eval_examples

    model = str(args.model or default_model_path())
    policies = args.policies or list(POLICIES)
    out = pathlib.Path(args.out)
    examples = eval_examples(args.per_family)
    measured: dict[tuple[int, str], list[dict]] = {}
    for block in args.block_sizes:
        engine_options = {p: {"diffusion_policy": p} for p in policies}
        if "elastic" in policies:
            profile = args.latency_profile or out.with_name(f"latency-b{block}.json")
            engine_options["elastic"]["latency_profile"] = str(
                ensure_latency_profile(model, block, profile))
        for _ in range(args.rounds):
            for policy in policies:
                with diffusion_llm(model, diffusion_block_size=block, max_model_len=1024,
                                   max_num_seqs=args.batch_size,
                                   max_num_batched_tokens=max(4096, 4 * block * args.batch_size),
                                   additional_config=engine_options[policy]) as llm:
                    result = run_policy(llm, examples, args.max_tokens)
                measured.setdefault((block, policy), []).append(result)
                print(f"B={block} {policy}: {result['output_tokens_per_s']:.0f} tok/s, "
                      f"mean accuracy {result['mean_accuracy']:.3f}", flush=True)
    results = []
    for block in args.block_sizes:
        speeds = {p: statistics.median(r["output_tokens_per_s"] for r in measured[(block, p)])
                  for p in policies}
        for policy in policies:
            cell = dict(measured[(block, policy)][0])
            cell["output_tokens_per_s_rounds"] = [r["output_tokens_per_s"]
                                                  for r in measured[(block, policy)]]
            cell["output_tokens_per_s"] = speeds[policy]
            cell["throughput_ratio"] = speeds[policy] / speeds.get("standard", speeds[policy])
            results.append({"block_size": block, "policy": policy, **cell})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": model, "batch_size": args.batch_size,
                               "per_family": args.per_family, "results": results},
                              indent=2) + "\n")
    plot(results, out.with_suffix(".png"))
    for r in results:
        groups = ", ".join(f"L{g['layers'][0]}-{g['layers'][1]} {g['positions_per_token']:.2f}"
                           for g in r["layer_groups"])
        print(f"B={r['block_size']:>2} {r['policy']:<8} acc {r['mean_accuracy']:.3f} "
              f"({', '.join(f'{f} {a:.2f}' for f, a in r['accuracy'].items())}) | "
              f"tok/step {r['tokens_committed_per_denoising_step']:.2f} | positions/token "
              f"{groups} | all rows/token {r['all_positions_per_committed_token']:.2f} | "
              f"{r['output_tokens_per_s']:.0f} tok/s ({r['throughput_ratio']:.2f}x)")


if __name__ == "__main__":
    main()
