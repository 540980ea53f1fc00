"""The block-diffusion loss curve of a checkpoint trained in stages, and where a power law
fitted to it says more training would lead.

Reads the ``step ... loss ...`` lines of the stage logs written by ``tools/train_sdar.py``
(in the order given), skips the autoregressive warm start, and places every logged window
on one cumulative step axis. The fit is ``loss = a * step ** -c`` by least squares on
log-log axes, over the stages named by ``--fit-stages`` (by default all that train on the
instruction corpus alone: a stage mixing in long-prompt retrieval batches logs a different
loss). The projection is the step at which the fitted curve reaches ``--target-loss`` (by
default the embedded tiny model's final loss), and its time at the speed measured in the
logs.

Usage:
    python tools/loss_curve.py training/logs/sdar-small-scratch/stage{1,2,3,4a,4b}.log \
        --fit-stages 1 2 3 --out results/loss_curve_small.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

STEP_LINE = re.compile(r"^step\s+(\d+)\s+loss\s+([\d.]+)\s+lr\s+\S+\s+tok/s\s+\d+\s+elapsed\s+(\d+)s")


def stage_windows(log: Path) -> tuple[list[tuple[int, float]], float]:
    """(step, mean loss) per logged window of the block-diffusion part, and seconds per step."""
    lines = log.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("block-diffusion training")), -1)
    windows, elapsed, last_step = [], 0.0, 0
    for line in lines[start + 1:]:
        match = STEP_LINE.match(line)
        if match:
            last_step, loss, elapsed = int(match[1]), float(match[2]), float(match[3])
            windows.append((last_step, loss))
    return windows, elapsed / max(last_step, 1)


def fit_power_law(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, c) of loss = a * step ** -c, least squares on log-log axes."""
    xs = [math.log(step) for step, _ in points]
    ys = [math.log(loss) for _, loss in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
             / sum((x - mean_x) ** 2 for x in xs))
    return math.exp(mean_y - slope * mean_x), -slope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", type=Path, nargs="+", help="stage logs, in training order")
    parser.add_argument("--fit-stages", type=int, nargs="+", default=None,
                        help="1-based indices of the logs the fit uses (default: all)")
    parser.add_argument("--skip-steps", type=int, default=200,
                        help="cumulative steps left out of the fit (warm-up transient)")
    parser.add_argument("--target-loss", type=float, default=0.08,
                        help="loss to project to (the embedded tiny model ended near 0.08)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    stages, offset = [], 0
    for index, log in enumerate(args.logs, start=1):
        windows, seconds_per_step = stage_windows(log)
        stages.append({"stage": index, "name": log.stem, "log": str(log), "first_step": offset,
                       "seconds_per_step": round(seconds_per_step, 2),
                       "windows": [(offset + step, loss) for step, loss in windows]})
        offset += windows[-1][0] if windows else 0
    fit_indices = set(args.fit_stages or range(1, len(stages) + 1))
    points = [p for s in stages if s["stage"] in fit_indices for p in s["windows"] if p[0] > args.skip_steps]
    a, c = fit_power_law(points)
    target_step = (a / args.target_loss) ** (1 / c)
    recent_speed = stages[-1]["seconds_per_step"]
    result = {
        "fit": {"a": a, "c": c, "stages": sorted(fit_indices), "points": len(points)},
        "steps_so_far": offset,
        "last_window_loss": stages[-1]["windows"][-1][1],
        "fitted_loss_now": a * offset ** -c,
        "target_loss": args.target_loss,
        "projected_steps_to_target": round(target_step),
        "projected_hours_at_last_stage_speed": round((target_step - offset) * recent_speed / 3600, 1),
        "projected_loss": {str(s): round(a * s ** -c, 3) for s in (offset * 2, offset * 4, offset * 10)},
        "stages": stages,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "stages"}, indent=1))
    plot(stages, a, c, target_step, args.target_loss, args.out.with_suffix(".png"))


def plot(stages: list[dict], a: float, c: float, target_step: float, target_loss: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for stage in stages:
        steps, losses = zip(*stage["windows"])
        ax.plot(steps, losses, ".", markersize=4, label=stage["name"])
    end = max(target_step, stages[-1]["windows"][-1][0]) * 1.1
    grid = [50 * 1.05 ** i for i in range(int(math.log(end / 50) / math.log(1.05)) + 1)]
    ax.plot(grid, [a * s ** -c for s in grid], "k--", linewidth=1, label=f"fit {a:.2f} * step^-{c:.2f}")
    ax.axhline(target_loss, color="grey", linewidth=0.8, label=f"target {target_loss}")
    ax.set(xscale="log", yscale="log", xlabel="block-diffusion steps (cumulative)", ylabel="masked-token loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
