"""Every registered decoding policy side by side in one run: accuracy and work.

For each block size (default: the model's own), one engine per policy the model serves
(each with its own default options, the papers' settings; ``elastic`` with a latency
profile of this machine, made first by ``tools/profile_latency.py`` unless given; a policy
the model refuses is listed with the reason), max_num_seqs = the batch size, and the
model's scored prompts (``harness.scored_prompts``: the converted default's definite
questions, the first ``--questions``; on a toy model, ``--model embedded`` or a directory,
the evaluation split's families interleaved) submitted at once, greedy. Reported per policy and block: exact-match accuracy per family with
95% Wilson intervals, tokens committed per denoising step, block positions through each
layer per committed token (and grouped into runs of layers with the same count), all rows
per committed token (prefill and commits included), output tokens/s and its ratio to
``standard`` at the same block size. ``--rounds`` > 1 repeats every engine, alternating
the policies (``harness.alternate``), and reports the median throughput. JSON and a PNG.

    python benchmarks/policy_comparison.py [--model DIR|embedded] [--block-sizes 16 32]
        [--batch-size 32] [--questions 357]
"""

from __future__ import annotations

import argparse
import functools
import math
import pathlib
import subprocess
import sys

import harness


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


def run_policy(llm, scored, max_tokens: int) -> dict:
    """The scored prompts answered greedily (after a warm-up): accuracy per family with
    95% intervals, the mean over families, throughput and the per-layer work grouped."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate(scored.prompts[:4], params, use_tqdm=False)
    run = harness.generate(llm, scored.prompts, params, counters=True)
    correct: dict[str, list[bool]] = {}
    for index, (family, out) in enumerate(zip(scored.families, run.outputs)):
        correct.setdefault(family, []).append(scored.score(index, out.outputs[0].text))
    accuracy = {f: sum(v) / len(v) for f, v in sorted(correct.items())}
    stats = run.stats
    return {
        "accuracy": accuracy, "output_tokens": run.output_tokens,
        **{k: stats[k] for k in ("tokens_committed_per_denoising_step",
                                 "layer_positions_per_committed_token",
                                 "all_positions_per_committed_token",
                                 "denoising_steps_per_block")},
        "accuracy_95ci": {f: wilson(sum(v), len(v)) for f, v in sorted(correct.items())},
        "mean_accuracy": sum(accuracy.values()) / len(accuracy),
        "output_tokens_per_s": run.tokens_per_s,
        "layer_groups": layer_groups(stats["layer_positions_per_committed_token"]),
    }


def refusals(model: str, policies: list[str]) -> dict[str, str]:
    """Why the model refuses each policy it cannot serve (``capabilities.refusal`` with
    the policy's default options)."""
    from vllm_diffusion.capabilities import refusal
    from vllm_diffusion.models.configs import model_capabilities
    from vllm_diffusion.policies import POLICIES

    capabilities = model_capabilities(harness.model_config(model))
    reasons = {p: refusal(capabilities, POLICIES[p], {}) for p in policies}
    return {p: r for p, r in reasons.items() if r is not None}


def ensure_latency_profile(model: str, block: int, path: pathlib.Path) -> pathlib.Path:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(harness.ROOT / "tools" / "profile_latency.py"),
                        "--model", model, "--block-size", str(block), "--out", str(path)],
                       check=True)
    return path


def plot(report: dict, path: pathlib.Path) -> None:
    results = report["results"]
    speed_accuracy: dict[str, list] = {}
    per_layer: dict[int, dict[str, list]] = {}
    for r in results:
        speed_accuracy[f"{r['policy']} B={r['block_size']}"] = [
            (r["throughput_ratio"], r["mean_accuracy"])]
        per_layer.setdefault(r["block_size"], {})[r["policy"]] = list(
            enumerate(r["layer_positions_per_committed_token"]))
    harness.plot_panels(path, [
        harness.Panel("accuracy vs speed", "throughput / standard",
                      "mean accuracy over families", speed_accuracy, log2_x=False),
        *(harness.Panel(f"work per layer, B={block}", "layer",
                        "block positions / committed token", lines, log2_x=False)
          for block, lines in sorted(per_layer.items()))], width=5)


def policy_engine(policy: str, block: int, args, model: str, engine_options: dict,
                  scored) -> dict:
    from vllm_diffusion_lab.offline import diffusion_llm

    with diffusion_llm(model, diffusion_block_size=block, max_model_len=1024,
                       max_num_seqs=args.batch_size,
                       max_num_batched_tokens=max(4096, 4 * block * args.batch_size),
                       additional_config=engine_options[policy]) as llm:
        result = run_policy(llm, scored, args.max_tokens)
    print(f"B={block} {policy}: {result['output_tokens_per_s']:.0f} tok/s, "
          f"mean accuracy {result['mean_accuracy']:.3f}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_options(parser, out="results/policy_comparison.json", rounds=1,
                               max_tokens=128, model_default="default")
    parser.add_argument("--policies", nargs="+", default=None,
                        help="default: every registered policy the model serves")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=None,
                        help="default: the model's own")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--questions", type=int, default=357,
                        help="how many scored prompts (the converted default has 357 "
                             "definite questions; a toy model's split cycles its families)")
    parser.add_argument("--latency-profile", type=pathlib.Path, default=None)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from vllm_diffusion.policies import POLICIES

    model = harness.model_path(args)
    block_sizes = args.block_sizes or [harness.model_config(model).block_size]
    refused = refusals(model, args.policies or list(POLICIES))
    for policy, reason in refused.items():
        print(f"{policy}: refused by the model ({reason})")
    if args.policies and refused:
        raise SystemExit("asked for policies the model refuses")
    policies = [p for p in args.policies or POLICIES if p not in refused]
    scored = harness.scored_prompts(model, AutoTokenizer.from_pretrained(model), args.questions)
    results = []
    for block in block_sizes:
        engine_options = {p: {"diffusion_policy": p} for p in policies}
        if "elastic" in policies:
            profile = args.latency_profile or args.out.with_name(f"latency-b{block}.json")
            engine_options["elastic"]["latency_profile"] = str(
                ensure_latency_profile(model, block, profile))
        measured = harness.alternate(policies, args.rounds, functools.partial(
            policy_engine, block=block, args=args, model=model,
            engine_options=engine_options, scored=scored))
        speeds = {p: harness.median_of(measured[p], "output_tokens_per_s",
                                       "output_tokens_per_s_rounds") for p in policies}
        for policy in policies:
            cell = {**measured[policy][0], **speeds[policy]}
            cell["throughput_ratio"] = (speeds[policy]["output_tokens_per_s"]
                                        / speeds.get("standard", speeds[policy])[
                                            "output_tokens_per_s"])
            results.append({"block_size": block, "policy": policy, **cell})
    harness.write_report({"model": model, "batch_size": args.batch_size,
                          "questions": args.questions, "refused": refused,
                          "results": results}, args.out, plot)
    for r in results:
        groups = ", ".join(f"L{g['layers'][0]}-{g['layers'][1]} {g['positions_per_token']:.2f}"
                           for g in r["layer_groups"])
        print(f"B={r['block_size']} {r['policy']:<8} acc {r['mean_accuracy']:.3f} "
              f"({', '.join(f'{f} {a:.2f}' for f, a in r['accuracy'].items())}) | "
              f"tok/step {r['tokens_committed_per_denoising_step']:.2f} | positions/token "
              f"{groups} | all rows/token {r['all_positions_per_committed_token']:.2f} | "
              f"{r['output_tokens_per_s']:.0f} tok/s ({r['throughput_ratio']:.2f}x)")


if __name__ == "__main__":
    main()
