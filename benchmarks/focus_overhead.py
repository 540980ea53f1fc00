"""How much of a FOCUS step goes to FOCUS itself (importance, selection, compaction)?

Times, inside one FOCUS run, FOCUS's forward hooks (the importance computation at layers
0/1 and the selection of the retained set: budget, constraints) and the decoder stack's
row and metadata compaction, against the wall time of the whole run. The paper reports
about 1% of step latency on GPUs with billion-parameter models; on this project's tiny
CPU models the model's own compute is small, so the share here is an upper bound of what larger models would see.

    python benchmarks/focus_overhead.py [--model DIR] [--block-size 32] [--batch-size 32]
        [--compiled] [--rounds 3]

``--compiled``: the engine at vLLM's default compilation (FOCUS's layers between its hook
points run as compiled pieces); eager otherwise. With ``--rounds`` above 1 the generation
is repeated and the report gives each round and the median share.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import pathlib
import time


def timed(totals: collections.Counter, name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
    return wrapper


def timed_rounds(llm, prompts: list, params, rounds: int,
                 totals: collections.Counter) -> list[dict]:
    """After a warm-up, ``rounds`` generations of ``prompts``: per round the engine steps,
    the wall time and the seconds ``totals`` collected (the policy's own work), per step and
    as a share of the wall time."""
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    reports = []
    for _ in range(rounds):
        totals.clear()
        steps = llm.collective_rpc("diffusion_stats")[0]["engine_steps"]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        steps = max(llm.collective_rpc("diffusion_stats")[0]["engine_steps"] - steps, 1)
        own = sum(totals.values())
        reports.append({"engine_steps": steps, "wall_time_s": round(wall, 3),
                        "ms_per_step": {k: round(1000 * v / steps, 3)
                                        for k, v in totals.items()},
                        "own_ms_per_step": 1000 * own / steps,
                        "share_of_wall_time": own / wall, "step_ms": 1000 * wall / steps})
    return reports


def write_report(setting: dict, reports: list[dict], out: str) -> None:
    """Write and print the setting, the rounds and the median share of the wall time."""
    shares = sorted(r["share_of_wall_time"] for r in reports)
    report = {**setting, "rounds": reports,
              "median_share_of_wall_time": shares[len(shares) // 2]}
    path = pathlib.Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default="results/focus_overhead.json")
    args = parser.parse_args()

    from vllm import SamplingParams

    from vllm_diffusion.default_model import default_model_path
    from vllm_diffusion.models.step_run import StepRun
    from vllm_diffusion.policies.focus import hooks
    from vllm_diffusion.step.rows import StepRows
    from vllm_diffusion_lab.offline import diffusion_llm
    from vllm_diffusion_lab.quality.corpus import mixed_eval_examples
    from vllm_diffusion_lab.quality.harness import chat_prompts

    totals: collections.Counter = collections.Counter()
    hooks.FocusStepHooks.__init__ = timed(totals, "hook_setup", hooks.FocusStepHooks.__init__)
    hooks.FocusStepHooks.before_attention = timed(
        totals, "importance_and_selection", hooks.FocusStepHooks.before_attention)
    for name in ("keep_queries", "keep_keys"):
        setattr(StepRows, name, timed(totals, "metadata_compaction",
                                      getattr(StepRows, name)))
    StepRun._keep = timed(totals, "row_compaction", StepRun._keep)
    model = str(args.model or default_model_path())
    with diffusion_llm(model, diffusion_block_size=args.block_size, max_model_len=1024,
                       max_num_seqs=args.batch_size, enforce_eager=not args.compiled,
                       additional_config={"diffusion_policy": "focus"}) as llm:
        prompts = chat_prompts(llm.get_tokenizer(), mixed_eval_examples(args.batch_size))
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        reports = timed_rounds(llm, prompts, params, args.rounds, totals)
    write_report({"model": model, "block_size": args.block_size,
                  "batch_size": args.batch_size, "compiled": args.compiled}, reports, args.out)

if __name__ == "__main__":
    main()
