"""Host work per engine step of two source trees, side by side: ``step_breakdown.py`` at
one batch size, one round per process, alternating "before" (a commit, as a git
worktree) and "after" (this checkout), each process importing its own tree's package
(``before_after.tree_environment``) and building the plugin's engine, then stock vLLM's.

Host work is the step less the forward and the logits; the excess is the plugin's less
stock vLLM's in the same process. Reported per tree: each round's figures and the medians
of the plugin's host work, stock vLLM's, the excess and every category. JSON and a PNG.

    python benchmarks/host_work_trees.py --before ee31cd4 --rounds 5
writes results/host_work_trees.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

import before_after
import harness


def host_ms(row: dict) -> float:
    return row["step_ms"] - row["ms_per_step"]["forward"] - row["ms_per_step"]["logits"]


def one_round(tree: pathlib.Path, scratch: pathlib.Path, batch: int, out: pathlib.Path) -> dict:
    """One ``step_breakdown.py`` process on ``tree``: its plugin and autoregressive rows."""
    subprocess.run([sys.executable, str(harness.ROOT / "benchmarks" / "step_breakdown.py"),
                    "--batch-sizes", str(batch), "--rounds", "1", "--out", str(out)],
                   env=before_after.tree_environment(tree, scratch), cwd=str(tree), check=True,
                   stdout=subprocess.DEVNULL)
    rows = {row["side"]: row for row in json.loads(out.read_text())["rows"]}
    plugin, autoregressive = rows["plugin"], rows["autoregressive"]
    return {"plugin_host_ms": host_ms(plugin), "autoregressive_host_ms": host_ms(autoregressive),
            "excess_ms": host_ms(plugin) - host_ms(autoregressive),
            "plugin_ms_per_step": plugin["ms_per_step"],
            "autoregressive_ms_per_step": autoregressive["ms_per_step"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a commit (or a directory)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--out", default="results/host_work_trees.json")
    args = parser.parse_args()
    trees = {"before": before_after.source_tree(args.before), "after": harness.ROOT}
    rounds: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(args.rounds):
            for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
                place = pathlib.Path(scratch) / f"{side}{r}"
                place.mkdir()
                result = one_round(trees[side], place, args.batch_size, place / "out.json")
                rounds[side].append(result)
                print(side, r, {k: round(v, 3) for k, v in result.items()
                                if isinstance(v, float)}, flush=True)

    def medians(results: list[dict]) -> dict:
        keys = ("plugin_host_ms", "autoregressive_host_ms", "excess_ms")
        summary = {k: statistics.median(r[k] for r in results) for k in keys}
        summary["plugin_ms_per_step"] = {
            c: statistics.median(r["plugin_ms_per_step"][c] for r in results)
            for c in results[0]["plugin_ms_per_step"]}
        return summary

    report = {"before": before_after.tree_commit(trees["before"]),
              "after": before_after.tree_commit(trees["after"]),
              "batch_size": args.batch_size, "rounds": args.rounds,
              "each_round": rounds, "medians": {s: medians(r) for s, r in rounds.items()}}
    harness.write_report(report, pathlib.Path(args.out), plot)


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for offset, side in ((-0.2, "before"), (0.2, "after")):
        runs = report["each_round"][side]
        xs = [i + offset for i in range(len(runs))]
        ax.bar(xs, [r["plugin_host_ms"] for r in runs], width=0.35, label=f"plugin, {side}")
        ax.scatter(xs, [r["autoregressive_host_ms"] for r in runs], color="black", zorder=3,
                   label="stock vLLM, same process" if side == "before" else None)
    ax.set_xlabel("round")
    ax.set_ylabel("host ms per engine step")
    ax.set_title(f"Host work per step at batch {report['batch_size']}: "
                 f"{report['before'][:8]} vs {report['after'][:8]}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
