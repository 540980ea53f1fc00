"""The converted default's decoding grid: block size x threshold (the ``threshold`` rule,
Fast-dLLM v2's), each run through ``real_model_quality.py`` on the first ``--limit``
definite questions and open requests of the evaluation set, reusing the original's answers
of an earlier report. Reports definite accuracy, the open answers' NLL under the original,
degenerate answers and tokens per denoising step for each cell (JSON and a PNG), from which
the checkpoint's ``diffusion_option_defaults`` are chosen.

    python benchmarks/real_model_grid.py --original-from results/real_model_original_answers.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

import harness


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--original-from", type=pathlib.Path, required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--cells", nargs="+",
                        default=["4:0.9", "4:0.5", "8:0.9", "8:0.7", "8:0.5", "8:0.3",
                                 "16:0.9", "16:0.5"],
                        help="block size:threshold pairs")
    parser.add_argument("--limit", type=int, default=80)
    parser.add_argument("--reuse", action="store_true",
                        help="take a cell's report from an earlier run where present")
    parser.add_argument("--out", type=pathlib.Path,
                        default=harness.ROOT / "results/real_model_grid.json")
    args = parser.parse_args()
    cells = []
    grid = [(int(b), float(t)) for b, t in (cell.split(":") for cell in args.cells)]
    for block, threshold in grid:
        out = args.out.with_name(f"{args.out.stem}_b{block}_t{threshold}.json")
        options = {"strategy": "threshold", "threshold": threshold,
                   "sub_block_size": None}
        command = [sys.executable, str(harness.ROOT / "benchmarks/real_model_quality.py"),
                   "--block-size", str(block), "--options", json.dumps(options),
                   "--limit", str(args.limit), "--original-from", str(args.original_from),
                   "--out", str(out)]
        if args.model:
            command += ["--model", args.model]
        if not (args.reuse and out.exists()):
            subprocess.run(command, check=True, capture_output=True)
        report = json.loads(out.read_text())
        cell = {"block_size": block, "threshold": threshold,
                "accuracy": report["accuracy"]["converted_greedy"],
                "original_accuracy": report["accuracy"]["original_greedy"],
                "accuracy_difference": report["accuracy_difference"],
                "open_nll": report["open_nll_mean"]["converted_greedy"],
                "original_t1_nll": report["open_nll_mean"]["original_t1"],
                "degenerate": report["open_answer_stats"]["converted_greedy"]["degenerate"],
                "original_degenerate":
                    report["open_answer_stats"]["original_greedy"]["degenerate"],
                "tokens_per_step": report["tokens_per_step"],
                "rows_per_committed_token": report["rows_per_committed_token"]}
        cells.append(cell)
        print(json.dumps(cell), flush=True)
    report = {"limit": args.limit, "cells": cells}

    def plot(r: dict, path: pathlib.Path) -> None:
        lines = {f"block {b}": [(c["tokens_per_step"], c["accuracy"]) for c in r["cells"]
                                if c["block_size"] == b] for b in sorted({b for b, _ in grid})}
        harness.plot_panels(path, [harness.Panel(
            "Definite accuracy against tokens per step", "tokens per denoising step",
            "accuracy", lines, log2_x=False, reference=cells[0]["original_accuracy"])])

    harness.write_report(report, args.out, plot)


if __name__ == "__main__":
    main()
