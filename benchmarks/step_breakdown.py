"""Where an engine step's time goes, for the plugin and for autoregressive decoding of the
same weights: scheduler, the runner's planning and input preparation, forward, logits,
proposals / sampling, commit choice, the scheduler's update, output processing
(detokenisation included), and the rest of the engine step.

Both sides run in this process, one engine at a time, at vLLM's defaults (compiled;
``--eager`` for both eager), on the embedded default model (the autoregressive side on a
copy whose config says ``Qwen3ForCausalLM``), with b greedy chat requests of the
evaluation families submitted at once and ``--max-tokens`` output tokens each
(``ignore_eos``). Every engine step of the measured run is timed by wrapping the engine's
own methods (inclusive times; each category's exclusive time is its inclusive time less
the categories nested in it); the JSON holds the mean milliseconds per engine step of each
category, the steps, output tokens per step and wall time per output token, per side and
batch size, and the PNG stacks them.

    python benchmarks/step_breakdown.py [--batch-sizes 1 4 16 64] [--rounds 1]
writes results/step_breakdown.{json,png}.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import statistics
import tempfile
import time

# category -> the categories timed inside it (their time is taken out of it)
NESTED = {
    "engine_step": ("schedule", "execute_model", "update_from_output", "output_processing"),
    "execute_model": ("planning", "forward", "logits", "proposals", "commit_choice"),
}
CATEGORIES = ("schedule", "planning", "runner_other", "forward", "logits", "proposals",
              "commit_choice", "update_from_output", "output_processing", "engine_other")


class StepClock:
    """Inclusive seconds per category for each engine step."""

    def __init__(self) -> None:
        self.steps: list[collections.Counter] = []
        self.current: collections.Counter | None = None

    def wrap(self, owner, attribute: str, category: str, step: bool = False) -> None:
        function = getattr(owner, attribute)
        clock = self

        def timed(*args, **kwargs):
            if step:
                clock.current = collections.Counter()
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                if clock.current is not None:
                    clock.current[category] += time.perf_counter() - start
                if step:
                    clock.steps.append(clock.current)
                    clock.current = None

        setattr(owner, attribute, timed)

    def exclusive(self, inclusive: collections.Counter) -> dict[str, float]:
        out = dict(inclusive)
        out["runner_other"] = inclusive["execute_model"] - sum(
            inclusive[c] for c in NESTED["execute_model"])
        out["engine_other"] = inclusive["engine_step"] - sum(
            inclusive[c] for c in NESTED["engine_step"])
        return {c: out.get(c, 0.0) for c in CATEGORIES}


def instrument(llm, diffusion: bool) -> StepClock:
    clock = StepClock()
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    clock.wrap(engine, "step", "engine_step", step=True)
    clock.wrap(core.scheduler, "schedule", "schedule")
    clock.wrap(core.scheduler, "update_from_output", "update_from_output")
    clock.wrap(engine.output_processor, "process_outputs", "output_processing")
    clock.wrap(runner, "execute_model", "execute_model")
    clock.wrap(runner.model, "forward", "forward")
    clock.wrap(runner.model, "compute_logits", "logits")
    if diffusion:
        clock.wrap(runner, "_plan", "planning")
        clock.wrap(runner.proposals, "propose", "proposals")
        clock.wrap(runner.policy, "choose_commits", "commit_choice")
    else:
        # vLLM's runner samples in a second call, which the engine core makes after
        # execute_model; it is counted with execute_model.
        clock.wrap(runner, "sample_tokens", "execute_model")
        clock.wrap(runner, "_prepare_inputs", "planning")
        clock.wrap(runner, "_sample", "proposals")
    return clock


def measure(llm, diffusion: bool, prompts: list[str], batch: int, max_tokens: int) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:batch], params, use_tqdm=False)  # warm-up at this batch
    clock = instrument(llm, diffusion)
    start = time.perf_counter()
    outputs = llm.generate(prompts[:batch], params, use_tqdm=False)
    wall = time.perf_counter() - start
    steps = [clock.exclusive(s) for s in clock.steps if s["engine_step"]]
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"batch_size": batch, "engine_steps": len(steps), "output_tokens": tokens,
            "tokens_per_step": tokens / max(len(steps), 1),
            "ms_per_step": {c: 1e3 * statistics.mean(s[c] for s in steps) for c in CATEGORIES},
            "step_ms": 1e3 * statistics.mean(sum(s.values()) for s in steps),
            "ms_per_output_token": 1e3 * wall / max(tokens, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--policy", default="standard")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results/step_breakdown.json"))
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # the same KV budget for both

    from vllm_diffusion.default_model import default_model_path
    from vllm_diffusion_lab.bench import autoregressive_copy
    from vllm_diffusion_lab.offline import autoregressive_llm, diffusion_llm
    from vllm_diffusion_lab.quality.corpus import mixed_eval_examples
    from vllm_diffusion_lab.quality.harness import chat_prompts

    model = default_model_path()
    examples = mixed_eval_examples(max(args.batch_sizes))
    runs: dict[str, dict[int, list[dict]]] = {"plugin": {}, "autoregressive": {}}
    with tempfile.TemporaryDirectory() as tmp:
        ar_model = autoregressive_copy(pathlib.Path(model), pathlib.Path(tmp))
        for _ in range(args.rounds):
            for side in runs:
                if side == "plugin":
                    engine = diffusion_llm(
                        model, diffusion_block_size=args.block_size, max_model_len=1024,
                        max_num_seqs=max(args.batch_sizes), enforce_eager=args.eager,
                        additional_config={"diffusion_policy": args.policy})
                else:
                    engine = autoregressive_llm(ar_model, max_num_seqs=max(args.batch_sizes),
                                                enforce_eager=args.eager)
                with engine as llm:
                    prompts = chat_prompts(llm.get_tokenizer(), examples)
                    for batch in args.batch_sizes:
                        result = measure(llm, side == "plugin", prompts, batch, args.max_tokens)
                        runs[side].setdefault(batch, []).append(result)
                        print(side, json.dumps(result), flush=True)
    report = {"model": str(model), "policy": args.policy, "block_size": args.block_size,
              "compiled": not args.eager, "max_tokens": args.max_tokens, "rounds": args.rounds,
              "machine": f"{os.cpu_count()} CPU cores", "categories": list(CATEGORIES),
              "rows": [summarise(side, batch, results)
                       for side, by_batch in runs.items() for batch, results in by_batch.items()]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))


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
