"""Paired comparison of quality-harness runs against a baseline option set.

Every option set of a harness run decodes the same held-out problems, so two sets are
compared problem by problem: ``lost`` counts problems the baseline answers and the other
set does not, ``gained`` the reverse, and the exact two-sided McNemar (sign) test on those
discordant pairs says whether the difference is more than chance. With 60 problems per
family a difference of a few problems is usually not.

    python -m vllm_diffusion_lab.quality.harness ... --out results/focus_split_small.json
    python benchmarks/paired_comparison.py results/focus_split_small.json \
        --baseline '{"strategy": "threshold", "threshold": 0.8}'

Prints a Markdown table and writes it as JSON next to the input (``*.paired.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib


def mcnemar_exact(lost: int, gained: int) -> float:
    """Two-sided exact p-value of ``lost`` vs ``gained`` discordant pairs under p = 1/2."""
    n = lost + gained
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(lost, gained) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired_difference_interval(lost: int, gained: int, total: int,
                               z: float = 1.96) -> tuple[float, float, float]:
    """The accuracy difference (row minus baseline) over ``total`` paired problems and its
    95% Wald interval for paired proportions: variance (b + c - (b - c)^2 / n) / n^2 with
    b, c the discordant counts (adequate at the hundreds of problems compared here)."""
    difference = (gained - lost) / total
    variance = (gained + lost - (gained - lost) ** 2 / total) / total ** 2
    half = z * math.sqrt(max(variance, 0.0))
    return round(difference, 4), round(difference - half, 4), round(difference + half, 4)


def compare(runs: list[dict], baseline: dict, baseline_block: int | None = None) -> list[dict]:
    """Each run against the baseline option set at its own block size, or, with
    ``baseline_block``, every run against the baseline at that block size."""
    rows = []
    for block_size in sorted({r["block_size"] for r in runs}):
        same_block = [r for r in runs if r["block_size"] == block_size]
        base_block = block_size if baseline_block is None else baseline_block
        base = next(r for r in runs if r["options"] == baseline and r["block_size"] == base_block)
        for run in same_block:
            lost = gained = 0
            for family, answers in run["correct_by_problem"].items():
                for ours, theirs in zip(answers, base["correct_by_problem"][family], strict=True):
                    lost += theirs and not ours
                    gained += ours and not theirs
            solved = sum(map(sum, run["correct_by_problem"].values()))
            total = sum(map(len, run["correct_by_problem"].values()))
            difference, low, high = paired_difference_interval(lost, gained, total)
            rows.append({"block_size": block_size, "options": run["options"], "solved": solved,
                         "difference": difference, "difference_interval_95": [low, high],
                         "tokens_per_s": round(run["output_tokens"] / run["wall_time_s"], 1),
                         "problems": total, "instruction_accuracy": run["instruction_accuracy"],
                         "instruction_interval_95": run["instruction_interval_95"],
                         "arithmetic": run["accuracy"].get("arithmetic"),
                         "lost": lost, "gained": gained, "p_value": mcnemar_exact(lost, gained),
                         "tokens_per_step": run["tokens_committed_per_denoising_step"],
                         "positions_0_1": run["block_positions_per_committed_token"],
                         "positions_later": run["later_layer_positions_per_committed_token"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=pathlib.Path, help="a quality-harness JSON")
    parser.add_argument("--baseline", default="{}", help="the baseline's option set, as JSON")
    parser.add_argument("--baseline-block", type=int, default=None,
                        help="compare every run with the baseline at this block size "
                             "(default: each block size with its own baseline)")
    args = parser.parse_args()
    runs = json.loads(args.results.read_text())["runs"]
    rows = compare(runs, json.loads(args.baseline), args.baseline_block)
    args.results.with_suffix(".paired.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("| B | options | solved | arith | instr. [95%] | lost / gained | p | difference [95%] "
          "| tok/step | positions 0-1 / later | tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        low, high = r["instruction_interval_95"]
        d_low, d_high = r["difference_interval_95"]
        print(f"| {r['block_size']} | `{json.dumps(r['options'])}` | {r['solved']}/{r['problems']} | "
              f"{r['arithmetic']:.2f} | {r['instruction_accuracy']:.2f} [{low:.2f}, {high:.2f}] | "
              f"{r['lost']} / {r['gained']} | {r['p_value']:.2f} | "
              f"{r['difference']:+.3f} [{d_low:+.3f}, {d_high:+.3f}] | {r['tokens_per_step']:.2f} | "
              f"{r['positions_0_1']:.2f} / {r['positions_later']:.2f} | {r['tokens_per_s']:.0f} |")


if __name__ == "__main__":
    main()
