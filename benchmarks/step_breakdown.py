"""Where an engine step's time goes, for the plugin and for autoregressive decoding of the
same weights: scheduler, the runner's planning and input preparation, forward, logits,
proposals / sampling, commit choice, the scheduler's update, output processing
(detokenisation included), and the rest of the engine step.

Both sides run in this process, one engine at a time, alternating in each of
``--rounds`` rounds (``harness.alternate``), at vLLM's defaults (compiled; ``--eager`` for
both eager), on the model (``--model``; the autoregressive side on a copy whose config
says ``Qwen3ForCausalLM``), with b greedy chat requests of the evaluation families
submitted at once and ``--max-tokens`` output tokens each (``ignore_eos``). Every engine
step of the measured run is timed by wrapping the engine's own methods
(``step_timing.StepClock``; each category's exclusive time is its inclusive time less the
categories nested in it); the JSON holds the mean milliseconds per engine step of each
category, the steps, output tokens per step and wall time per output token, per side and
batch size (medians over the rounds), and the PNG stacks them.

    python benchmarks/step_breakdown.py [--batch-sizes 1 4 16 64] [--rounds 1]
writes results/step_breakdown.{json,png}.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import statistics
import tempfile

import harness
from step_timing import StepClock, exclusive, mean_ms, model_runner

# category -> (its rest, the categories timed inside it, whose time is taken out of it)
NESTED = {
    "engine_step": ("engine_other", ("schedule", "execute_model", "update_from_output",
                                     "output_processing")),
    "execute_model": ("runner_other", ("planning", "forward", "logits", "proposals",
                                       "commit_choice")),
}
CATEGORIES = ("schedule", "planning", "runner_other", "forward", "logits", "proposals",
              "commit_choice", "update_from_output", "output_processing", "engine_other")
SIDES = ("plugin", "autoregressive")


def instrument(llm, diffusion: bool) -> StepClock:
    clock = StepClock()
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    runner = model_runner(llm)
    clock.wrap(engine, "step", "engine_step", step=True)
    clock.wrap(core.scheduler, "schedule", "schedule")
    clock.wrap(core.scheduler, "update_from_output", "update_from_output")
    clock.wrap(engine.output_processor, "process_outputs", "output_processing")
    clock.wrap(runner, "execute_model", "execute_model")
    clock.wrap(runner.model, "forward", "forward")
    clock.wrap(runner.model, "compute_logits", "logits")
    if diffusion:
        clock.wrap(runner, "_prepare", "planning")
        clock.wrap(runner.proposals, "propose", "proposals")
        clock.wrap(runner.policy, "decide", "commit_choice")
    else:
        # vLLM's runner samples in a second call, which the engine core makes after
        # execute_model; it is counted with execute_model.
        clock.wrap(runner, "sample_tokens", "execute_model")
        clock.wrap(runner, "_prepare_inputs", "planning")
        clock.wrap(runner, "_sample", "proposals")
    return clock


def side_engine(side: str, args, model, ar_model, examples) -> dict[int, dict]:
    """One engine of ``side`` through every batch size (a warm-up run at each first)."""
    from vllm import SamplingParams

    from vllm_diffusion_lab.offline import autoregressive_llm, diffusion_llm
    from vllm_diffusion_lab.quality.harness import chat_prompts

    if side == "plugin":
        engine = diffusion_llm(model, diffusion_block_size=args.block_size, max_model_len=1024,
                               max_num_seqs=max(args.batch_sizes), enforce_eager=args.eager,
                               additional_config={"diffusion_policy": args.policy})
    else:
        engine = autoregressive_llm(ar_model, max_num_seqs=max(args.batch_sizes),
                                    enforce_eager=args.eager)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                            extra_args=(args.options or None) if side == "plugin" else None)
    results = {}
    with engine as llm, instrument(llm, side == "plugin") as clock:
        prompts = chat_prompts(llm.get_tokenizer(), examples)
        for batch in args.batch_sizes:
            llm.generate(prompts[:batch], params, use_tqdm=False)  # warm-up at this batch
            clock.clear()
            run = harness.generate(llm, prompts[:batch], params)
            steps = [exclusive(s.seconds, NESTED) for s in clock.steps if s.seconds["engine_step"]]
            results[batch] = {
                "batch_size": batch, "engine_steps": len(steps),
                "output_tokens": run.output_tokens,
                "tokens_per_step": run.output_tokens / max(len(steps), 1),
                "ms_per_step": mean_ms(steps, CATEGORIES),
                "step_ms": 1e3 * statistics.mean(sum(s[c] for c in CATEGORIES) for s in steps),
                "ms_per_output_token": 1e3 * run.seconds / max(run.output_tokens, 1)}
            print(side, results[batch], flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_options(parser, out="results/step_breakdown.json",
                               batch_sizes=[1, 4, 16, 64], rounds=1, max_tokens=64)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--policy", default="standard")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--options", type=json.loads, default=None,
                        help="the plugin's per-request options as JSON, e.g. "
                             "'{\"threshold\": 0.8}' (default: none, the policy's defaults)")
    harness.add_prompt_set_option(parser)
    args = parser.parse_args()
    harness.engines_in_process()

    from vllm_diffusion_lab.bench import autoregressive_copy
    model = harness.model_path(args)
    examples = harness.workload_examples(args, max(args.batch_sizes))
    with tempfile.TemporaryDirectory() as tmp:
        ar_model = autoregressive_copy(pathlib.Path(model), pathlib.Path(tmp))
        measured = harness.alternate(SIDES, args.rounds, functools.partial(
            side_engine, args=args, model=model, ar_model=ar_model, examples=examples))
    report = {"model": model, "policy": args.policy, "block_size": args.block_size,
              "options": args.options,
              "compiled": not args.eager, "max_tokens": args.max_tokens, "rounds": args.rounds,
              "prompt_set": args.prompt_set,
              "machine": f"{os.cpu_count()} CPU cores", "categories": list(CATEGORIES),
              "rows": [summarise(side, batch, results) for side in SIDES
                       for batch, results in harness.by_batch(measured[side]).items()]}
    harness.write_report(report, args.out, plot)


def summarise(side: str, batch: int, results: list[dict]) -> dict:
    """Medians over rounds."""
    def median(key):
        return statistics.median(r[key] for r in results)

    return {"side": side, "batch_size": batch, "engine_steps": median("engine_steps"),
            "tokens_per_step": median("tokens_per_step"), "step_ms": median("step_ms"),
            "ms_per_output_token": median("ms_per_output_token"),
            "ms_per_step": {c: statistics.median(r["ms_per_step"][c] for r in results)
                            for c in CATEGORIES}}


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(report["rows"], key=lambda r: (r["batch_size"], r["side"]))
    labels = [f"{'AR' if r['side'] == 'autoregressive' else 'plugin'}\nb={r['batch_size']}"
              for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4.5))
    bottom = [0.0] * len(rows)
    colours = plt.cm.tab10.colors
    for index, category in enumerate(report["categories"]):
        values = [r["ms_per_step"][category] for r in rows]
        ax.bar(labels, values, bottom=bottom, label=category, color=colours[index % 10])
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, r in enumerate(rows):
        ax.text(x, bottom[x], f"{r['tokens_per_step']:.2f} tok", ha="center", va="bottom",
                fontsize=7)
    ax.set_ylabel("ms per engine step")
    ax.set_title(f"Engine step breakdown, {report['policy']} B={report['block_size']} vs "
                 f"autoregressive ({'compiled' if report['compiled'] else 'eager'})")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
