"""What the comparison benchmarks share: the common options, configurations run in
alternating rounds, medians over the rounds (each round kept), ratios side by side, and a
JSON report with its PNG.

A configuration is a name and a function that opens its engine, measures and closes it,
in this process (``vllm_diffusion_lab.offline``: one engine at a time) or in a child
process (``run_child``) where a fresh process is the point (peak memory, another source
tree). Every round runs every configuration once, so a slow period of the machine falls
on all of them rather than on one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]


def add_common_options(parser, *, out: str, batch_sizes: Sequence[int] | None = None,
                       rounds: int | None = None, max_tokens: int | None = None,
                       model: bool = True,
                       model_default: str | None = None) -> None:
    """``--out`` (relative to the repository root by default), and each of ``--batch-sizes``,
    ``--rounds``, ``--max-tokens`` and ``--model`` whose default is given (``--model``'s
    own default: ``model_default``, the embedded model where None)."""
    if batch_sizes is not None:
        parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(batch_sizes))
    if rounds is not None:
        parser.add_argument("--rounds", type=int, default=rounds,
                            help="each configuration once per round; throughput is the "
                                 "median over the rounds")
    if max_tokens is not None:
        parser.add_argument("--max-tokens", type=int, default=max_tokens)
    if model:
        parser.add_argument("--model", default=model_default,
                            help="checkpoint directory; 'default': the converted SmolLM2 "
                                 "(tools/build_smollm2.py --converted); 'embedded': the "
                                 "embedded SDAR model, checkpoints/sdar-small-chat; "
                                 f"default: {model_default or 'embedded'}")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / out)


def add_prompt_set_option(parser) -> None:
    """``--prompt-set``: the evaluation split's prompts (scored) or the unscored chat prompts
    of other kinds (``vllm_diffusion_lab.quality.chat_set``)."""
    parser.add_argument("--prompt-set", choices=("eval", "chat"), default="eval",
                        help="eval: the evaluation split's families, scored; chat: chat "
                             "prompts of other kinds, not scored")


def workload_examples(args, count: int) -> list:
    """``count`` examples of ``--prompt-set`` (those of the chat set have empty answers)."""
    if args.prompt_set == "chat":
        from vllm_diffusion_lab.quality.chat_set import chat_examples

        return chat_examples(count)
    from vllm_diffusion_lab.quality.corpus import mixed_eval_examples

    return mixed_eval_examples(count)


def model_path(args) -> str:
    from vllm_diffusion.default_model import default_model_path, embedded_model_path

    if args.model == "default":
        return str(default_model_path())
    if args.model in (None, "embedded"):
        return str(embedded_model_path())
    return str(args.model)


def model_config(model: str) -> Any:
    """The checkpoint's configuration as the engine reads it (the plugin's configs
    registered), e.g. its ``block_size``."""
    from transformers import AutoConfig

    from vllm_diffusion.models.configs import register_hf_configs

    register_hf_configs()
    return AutoConfig.from_pretrained(model)


@dataclasses.dataclass
class ScoredPrompts:
    """A model's evaluation prompts, each with its family and a scorer: the converted
    default's definite questions (``vllm_diffusion_lab.real_model.evaluation_set``), or the
    toy models' evaluation split (the task families interleaved)."""

    prompts: list[Any]  # what ``LLM.generate`` takes: token-id dicts or strings
    families: list[str]
    score: Callable[[int, str], bool]  # (prompt index, answer text) -> correct


def scored_prompts(model: str, tokenizer, count: int) -> ScoredPrompts:
    """``count`` scored prompts for ``model`` (the converted default, or a toy model)."""
    from vllm_diffusion.default_model import converted_model_dir

    if pathlib.Path(model).resolve() == converted_model_dir().resolve():
        from vllm_diffusion_lab.real_model.evaluation import STOP, chat_prompt_ids
        from vllm_diffusion_lab.real_model.evaluation_set import (DEFINITE_QUESTIONS,
                                                                  score_definite)

        questions = [DEFINITE_QUESTIONS[i % len(DEFINITE_QUESTIONS)] for i in range(count)]
        ids = chat_prompt_ids(tokenizer, [q.prompt for q in questions])
        return ScoredPrompts([{"prompt_token_ids": p} for p in ids],
                             [q.kind for q in questions],
                             lambda i, text: score_definite(questions[i], text.split(STOP)[0]))
    from vllm_diffusion_lab.quality.corpus import mixed_eval_examples, score
    from vllm_diffusion_lab.quality.harness import chat_prompts

    examples = mixed_eval_examples(count)
    return ScoredPrompts(chat_prompts(tokenizer, examples), [e.family for e in examples],
                         lambda i, text: score(examples[i].family, examples[i].answer, text))


def autoregressive_counterpart(checkpoint: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    """What stock vLLM decodes autoregressively against ``checkpoint``: the original
    SmolLM2-135M-Instruct for the converted default, else the same weights with the config
    naming Qwen3 (``vllm_diffusion_lab.bench.autoregressive_copy``, written under ``into``)."""
    from vllm_diffusion.default_model import converted_model_dir

    if checkpoint.resolve() == converted_model_dir().resolve():
        from vllm_diffusion_lab.real_model import original_checkpoint

        return original_checkpoint()
    from vllm_diffusion_lab.bench import autoregressive_copy

    return autoregressive_copy(checkpoint, into)


def engines_in_process() -> None:
    """The engine core in this process (the step-timing wrappers reach it) and the same KV
    budget for every engine."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def package_files() -> dict[str, str]:
    """Where this process imported the serving package and the lab from."""
    import vllm_diffusion
    import vllm_diffusion_lab

    return {"vllm_diffusion": vllm_diffusion.__file__,
            "vllm_diffusion_lab": vllm_diffusion_lab.__file__}


def alternate(names: Sequence[str], rounds: int, run: Callable[[str], Any], *,
              swap: bool = False) -> dict[str, list[Any]]:
    """``rounds`` rounds of ``run(name)`` for every configuration, in the given order (with
    ``swap``, reversed every other round); returns each configuration's results, one per
    round."""
    results: dict[str, list[Any]] = {name: [] for name in names}
    for index in range(rounds):
        order = list(reversed(names)) if swap and index % 2 else list(names)
        for name in order:
            start = time.perf_counter()
            results[name].append(run(name))
            print(f"round {index + 1}/{rounds}: {name} ({time.perf_counter() - start:.0f} s)",
                  file=sys.stderr, flush=True)
    return results


def by_batch(rounds: Iterable[dict[int, Any]]) -> dict[int, list[Any]]:
    """Per-round ``{batch: result}`` turned into ``{batch: [result of each round]}``."""
    cells: dict[int, list[Any]] = {}
    for measured in rounds:
        for batch, result in measured.items():
            cells.setdefault(batch, []).append(result)
    return cells


def median_of(results: Sequence[dict], key: str, each_round: str | None = None) -> dict:
    """``{key: the median over the rounds, each_round: every round's value}``."""
    values = [r[key] for r in results]
    return {key: statistics.median(values), (each_round or f"{key}_each_round"): values}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def speed_row(config: str, batch: int, runs: Sequence[dict],
              ar_tokens_per_s: float | None) -> dict:
    """The fields every table against autoregressive decoding has, from one
    configuration's runs at one batch size (each with ``tokens_per_s``, ``output_tokens``
    and ``rows_per_committed_token``): the median tokens/s and every round's, its ratio to
    ``ar_tokens_per_s`` (None for an autoregressive row), mean output tokens and rows."""
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in runs)
    return {"config": config, "batch_size": batch, **median_of(runs, "tokens_per_s"),
            "ratio_to_autoregressive": ratio(tokens_per_s, ar_tokens_per_s),
            "output_tokens": statistics.mean(r["output_tokens"] for r in runs),
            "rows_per_committed_token": statistics.mean(
                r["rows_per_committed_token"] for r in runs)}


@dataclasses.dataclass
class Generation:
    """One ``llm.generate`` call timed, with the diffusion counters it moved."""

    outputs: list
    seconds: float
    stats: dict | None

    @property
    def output_tokens(self) -> int:
        return sum(len(o.outputs[0].token_ids) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def token_ids(self) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in self.outputs]


def diffusion_counters(llm) -> dict:
    return llm.collective_rpc("diffusion_stats")[0]


def generate(llm, prompts: list, params, *, counters: bool = False) -> Generation:
    """``prompts`` submitted at once; ``counters``: also the diffusion counters' delta."""
    from vllm_diffusion_lab.offline import stats_delta

    before = diffusion_counters(llm) if counters else None
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = stats_delta(before, diffusion_counters(llm)) if counters else None
    return Generation(outputs, seconds, stats)


def run_child(argv: Sequence[str], *, env: dict[str, str] | None = None,
              cwd: pathlib.Path | None = None, result: pathlib.Path | None = None) -> dict:
    """A fresh Python process running ``argv``; the JSON it wrote to ``result``, or else its
    last stdout line as JSON."""
    child = subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True,
                           env=env, cwd=cwd, check=False)
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))} failed:\n{child.stderr[-4000:]}")
    if result is not None:
        return json.loads(result.read_text())
    return json.loads(child.stdout.strip().splitlines()[-1])


def write_report(report: dict, out: pathlib.Path,
                 plot: Callable[[dict, pathlib.Path], None] | None = None) -> None:
    """The report as JSON at ``out`` and, with ``plot``, its figure next to it (.png)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    if plot is not None:
        plot(report, out.with_suffix(".png"))


@dataclasses.dataclass
class Panel:
    """One chart: a line per label through its (x, y) points."""

    title: str
    xlabel: str
    ylabel: str
    lines: dict[str, list[tuple[float, float]]]
    log2_x: bool = True
    reference: float | None = None  # a horizontal line (a ratio of 1, an objective)
    dashed: Callable[[str], bool] = lambda label: False


def plot_speed_and_rows(report: dict, path: pathlib.Path,
                        dashed: Callable[[str], bool]) -> None:
    """Two charts of ``report["rows"]`` (``speed_row``s) against batch size: output
    tokens/s, and rows computed per committed token."""
    speed: dict[str, list] = {}
    rows: dict[str, list] = {}
    for r in report["rows"]:
        speed.setdefault(r["config"], []).append((r["batch_size"], r["tokens_per_s"]))
        rows.setdefault(r["config"], []).append((r["batch_size"],
                                                 r["rows_per_committed_token"]))
    plot_panels(path, [
        Panel(f"Output tokens/s ({report['machine']})", "batch size", "tokens/s", speed,
              dashed=dashed),
        Panel("Rows computed per committed token", "batch size", "rows / token", rows,
              dashed=dashed)])


def plot_panels(path: pathlib.Path, panels: Sequence[Panel], width: float = 5.5) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for label, points in panel.lines.items():
            if points:
                ax.plot(*zip(*points), marker="o", label=label,
                        linestyle="--" if panel.dashed(label) else "-")
        if panel.reference is not None:
            ax.axhline(panel.reference, color="grey", linewidth=0.8)
        if panel.log2_x:
            ax.set_xscale("log", base=2)
        ax.set(title=panel.title, xlabel=panel.xlabel, ylabel=panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
