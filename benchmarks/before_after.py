"""Two source trees side by side: the plugin's equal-work throughput against stock vLLM
autoregressive decoding, "before" (a commit, checked out as a git worktree) and "after"
(this checkout's working tree by default), alternating in one run.

Each round runs ``throughput_vs_ar.py`` once per tree (``--configs autoregressive
<config>... --rounds 1``: the plugin configurations, then stock vLLM (the same weights, or
the original model of the converted default) generating per request as many tokens as
each plugin configuration did, ``ignore_eos``), each in a fresh
process whose imports resolve to that tree, the order reversed every other round. Both
trees run this checkout's measuring code on the same model (``--model``, by default this
checkout's embedded model), so only the serving package and its lab (each tree's own)
differ.

How a child imports its own tree: the package is installed editable, and setuptools'
editable finder sits at the end of ``sys.meta_path``, after the path finder, so a tree on
``PYTHONPATH`` (the tree and its ``lab/``) wins over the installed mapping. vLLM loads the
plugin through the ``vllm.general_plugins`` entry point (``importlib.metadata``), which
imports ``vllm_diffusion`` by name, hence from the same path; a ``dist-info`` written from
the tree's own ``pyproject.toml`` and placed first on the path makes its entry points the
ones vLLM sees. Each child reports the ``vllm_diffusion.__file__`` it imported, and the
run stops if that is not inside its tree.

Reported per configuration and batch size: each tree's median plugin and autoregressive tokens/s over the
rounds (every round kept), the plugin / autoregressive ratio of the medians, and after /
before of the plugin's medians and of those ratios (the second is insensitive to a slower
period of the machine that falls on both engines of one tree's run); ``meets_target``: after / before of the plugin's medians
at least ``--target`` at every batch size. JSON and a PNG.

    python benchmarks/before_after.py --before 5955a8a --batch-sizes 1 64 --rounds 5
    python benchmarks/before_after.py --before 4a996e3 --model default \
        --config standard elastic "chunk 2, reuse" --batch-sizes 1 4 16 64 --ignore-eos
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import pathlib
import statistics
import subprocess
import tempfile
import tomllib

import harness
from throughput_vs_ar import AR_AS, CONFIGS

SIDES = ("before", "after")


def source_tree(spec: str) -> pathlib.Path:
    """A directory as given, or a git worktree of the commit ``spec`` under /tmp (made once)."""
    if pathlib.Path(spec).is_dir():
        return pathlib.Path(spec).resolve()
    commit = subprocess.run(["git", "-C", str(harness.ROOT), "rev-parse", "--verify",
                             f"{spec}^{{commit}}"], capture_output=True, text=True,
                            check=True).stdout.strip()
    tree = pathlib.Path(tempfile.gettempdir()) / f"vllm-diffusion-{commit[:12]}"
    if not tree.is_dir():
        subprocess.run(["git", "-C", str(harness.ROOT), "worktree", "add", "--detach",
                        str(tree), commit], check=True)
    return tree


def tree_commit(tree: pathlib.Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()


def tree_environment(tree: pathlib.Path, scratch: pathlib.Path) -> dict[str, str]:
    """The environment of a child importing ``tree``'s package and lab, with the tree's own
    entry points."""
    project = tomllib.loads((tree / "pyproject.toml").read_text())["project"]
    info = scratch / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\n"
                                   f"Version: {project['version']}\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in entries.items()) + "\n"
        for group, entries in project.get("entry-points", {}).items()))
    paths = [str(scratch), str(tree), str(tree / "lab"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def measure_tree(side: str, args, trees, scratch: pathlib.Path, runs: itertools.count) -> dict:
    """One round of ``throughput_vs_ar.py`` in a child importing ``side``'s tree."""
    out = scratch / f"{side}-{next(runs)}.json"
    argv = [harness.ROOT / "benchmarks/throughput_vs_ar.py", "--configs", "autoregressive",
            *args.config, "--batch-sizes", *args.batch_sizes, "--rounds", "1",
            "--max-tokens", args.max_tokens, "--min-requests", args.min_requests,
            "--model", args.model, "--shape", args.shape, "--prompt-set", args.prompt_set,
            "--out", out]
    if args.eager:
        argv += ["--plugin-eager", "--ar-eager"]
    if args.ignore_eos:
        argv += ["--ignore-eos"]
    report = harness.run_child(argv, env=tree_environment(trees[side], scratch / side),
                               cwd=trees[side], result=out)
    imported = pathlib.Path(report["package"]["vllm_diffusion"]).resolve()
    if not imported.is_relative_to(trees[side]):
        raise SystemExit(f"the {side} child imported vllm_diffusion from {imported}, "
                         f"not from {trees[side]}")
    return report


def side_summary(reports: list[dict], config: str, batch: int) -> dict:
    def each_round(row: str, key: str) -> list:
        return [next(r[key] for r in report["rows"]
                     if r["config"] == row and r["batch_size"] == batch) for report in reports]

    plugin, ar = each_round(config, "tokens_per_s"), each_round(AR_AS + config, "tokens_per_s")
    return {"plugin_tokens_per_s": statistics.median(plugin),
            "plugin_tokens_per_s_each_round": plugin,
            "autoregressive_tokens_per_s": statistics.median(ar),
            "autoregressive_tokens_per_s_each_round": ar,
            "ratio_to_autoregressive": statistics.median(plugin) / statistics.median(ar),
            "output_tokens_each_round": each_round(config, "output_tokens")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_options(parser, out="results/before_after.json", batch_sizes=[1, 64],
                               rounds=5, max_tokens=96)
    parser.add_argument("--before", required=True, help="a commit or a source tree")
    parser.add_argument("--after", default=str(harness.ROOT), help="a commit or a source tree "
                        "(default: this checkout's working tree)")
    parser.add_argument("--config", nargs="+", default=["standard B=4"],
                        choices=[name for name, config in CONFIGS.items() if config],
                        help="one or more plugin configurations, measured in the same "
                             "child process per round (one autoregressive engine for all)")
    parser.add_argument("--shape", choices=("embedded", "large"), default="embedded",
                        help="large: throughput_vs_ar.py's compute-bound random shape "
                             "(its own model and prompts; --model is then unused)")
    harness.add_prompt_set_option(parser)
    parser.add_argument("--ignore-eos", action="store_true",
                        help="fixed-length outputs of --max-tokens on both sides")
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument("--eager", action="store_true", help="both sides' engines eager "
                        "(default: vLLM's compilation, as throughput_vs_ar.py)")
    parser.add_argument("--target", type=float, default=0.95, help="after / before at least")
    args = parser.parse_args()
    args.model = str(pathlib.Path(harness.model_path(args)).resolve())  # children run elsewhere
    trees = {"before": source_tree(args.before), "after": source_tree(args.after)}
    with tempfile.TemporaryDirectory() as tmp:
        measured = harness.alternate(SIDES, args.rounds, functools.partial(
            measure_tree, args=args, trees=trees, scratch=pathlib.Path(tmp),
            runs=itertools.count(1)), swap=True)
    rows = []
    for config, batch in itertools.product(args.config, args.batch_sizes):
        sides = {side: side_summary(measured[side], config, batch) for side in SIDES}
        before, after = sides["before"], sides["after"]
        rows.append({"config": config, "batch_size": batch, **sides,
                     "plugin_after_over_before":
                         after["plugin_tokens_per_s"] / before["plugin_tokens_per_s"],
                     "ratio_to_autoregressive_after_over_before":
                         after["ratio_to_autoregressive"] / before["ratio_to_autoregressive"],
                     "same_output_tokens": (before["output_tokens_each_round"]
                                            == after["output_tokens_each_round"])})
    report = {side: {"tree": str(trees[side]), "head_commit": tree_commit(trees[side]),
                     "package": measured[side][0]["package"]} for side in SIDES}
    report.update(config=args.config, model=args.model, compiled=not args.eager,
                  max_tokens=args.max_tokens, min_requests=args.min_requests,
                  rounds=args.rounds, target=args.target,
                  machine=measured["after"][0]["machine"], rows=rows,
                  meets_target=all(r["plugin_after_over_before"] >= args.target for r in rows))
    harness.write_report(report, args.out, plot)
    print("| config | batch | plugin tok/s before / after | after / before | plugin / AR "
          "before / after | after / before |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['batch_size']} | "
              f"{r['before']['plugin_tokens_per_s']:.0f} / "
              f"{r['after']['plugin_tokens_per_s']:.0f} | {r['plugin_after_over_before']:.3f} | "
              f"{r['before']['ratio_to_autoregressive']:.2f} / "
              f"{r['after']['ratio_to_autoregressive']:.2f} | "
              f"{r['ratio_to_autoregressive_after_over_before']:.3f} |")
    print(f"after / before at least {args.target}: {report['meets_target']}")


def plot(report: dict, path: pathlib.Path) -> None:
    panels = []
    for r in report["rows"]:
        lines = {f"{side}, {who}": list(enumerate(r[side][f"{key}_each_round"], start=1))
                 for side in SIDES for who, key in (("plugin", "plugin_tokens_per_s"),
                                                     ("AR", "autoregressive_tokens_per_s"))}
        panels.append(harness.Panel(f"{r['config']}, batch {r['batch_size']}", "round",
                                    "output tokens/s", lines, log2_x=False,
                                    dashed=lambda label: label.endswith("AR")))
    harness.plot_panels(path, panels)


if __name__ == "__main__":
    main()
