"""Host cost of the standard policy's decision per step, one thread: ``policy.decide`` over
a step's blocks (with the runner's entropy question), median of ``--repeats`` x
``--calls`` calls after a warm-up, per batch size, block size and rule. JSON and a PNG.

Trees from before 8beec0b decided through the policy's ``unmasking`` (``wants_entropy``,
``choose_commits``, ``scheduled_idle``, ``choose_edits``); the script times that sequence
there, so that the same command compares the two (run it from the other tree's directory
with that tree and its ``lab/`` first on ``PYTHONPATH``):

    python benchmarks/decision_cost.py --out results/decision_cost.json
    cd /tmp/before && PYTHONPATH=/tmp/before:/tmp/before/lab python \\
        /path/to/checkout/benchmarks/decision_cost.py --out /tmp/decision_cost_before.json
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time
import types

import torch

import harness

MASK = 99
SHAPES = ((1, 4), (16, 32), (64, 32))  # (batch, block size)
RULES = ("low_confidence_dynamic", "threshold")


def decision_call(batch: int, block: int, strategy: str):
    """A zero-argument call deciding one step of ``batch`` blocks (70% masked)."""
    from vllm_diffusion.capabilities import ModelCapabilities
    from vllm_diffusion.policies.standard import StandardConfig, StandardPolicy
    from vllm_diffusion.step.request import DiffusionRequest

    policy = StandardPolicy(block, MASK, StandardConfig())
    policy.bind(ModelCapabilities(family="SDAR"), types.SimpleNamespace(num_hidden_layers=4),
                False)
    config = StandardConfig(strategy=strategy, threshold=0.9)
    requests = []
    for i in range(batch):
        request = DiffusionRequest(f"r{i}", config, policy.new_state(config), False)
        request.canvas = types.SimpleNamespace(steps=i % 3, post_steps=0)
        requests.append(request)
    gen = torch.Generator().manual_seed(0)
    confidence = torch.rand(batch, block, generator=gen)
    masked = torch.rand(batch, block, generator=gen) < 0.7
    proposals = torch.randint(100, 1000, (batch, block), generator=gen)
    tokens = torch.where(masked, MASK, proposals)
    if hasattr(policy, "decide"):
        from vllm_diffusion.step.plans import StepBlocks

        def call():
            any(r.policy_config.needs_entropy for r in requests)
            return policy.decide(StepBlocks(requests, confidence, masked, proposals, tokens,
                                            ~masked))
        return call
    from vllm_diffusion.step.plans import CommitBatch, EditBatch  # the earlier interface

    unmasking = policy.unmasking

    def call():
        unmasking.wants_entropy(requests)
        commit_batch = CommitBatch(requests, confidence, masked)
        commits = unmasking.choose_commits(commit_batch)
        unmasking.scheduled_idle(commit_batch)
        unmasking.choose_edits(EditBatch(requests, confidence, proposals, tokens, ~masked))
        return commits
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/decision_cost.json")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for (batch, block), strategy in ((s, r) for s in SHAPES for r in RULES):
        call = decision_call(batch, block, strategy)
        for _ in range(50):
            call()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            times.append((time.perf_counter() - start) / args.calls * 1e6)
        rows.append({"batch_size": batch, "block_size": block, "strategy": strategy,
                     "microseconds": statistics.median(times), "each_repeat": times})
        print(f"batch {batch} block {block} {strategy}: {rows[-1]['microseconds']:.1f} us")
    out = pathlib.Path(args.out)
    harness.write_report({"package": harness.package_files(), "rows": rows},
                         out if out.is_absolute() else harness.ROOT / out, plot)


def plot(report: dict, path: pathlib.Path) -> None:
    lines: dict[str, list] = {}
    for r in report["rows"]:
        lines.setdefault(f"{r['strategy']}", []).append((r["batch_size"], r["microseconds"]))
    harness.plot_panels(path, [harness.Panel("The standard policy's decision per step",
                                             "batch size (blocks)", "microseconds",
                                             lines)], width=7)


if __name__ == "__main__":
    main()
