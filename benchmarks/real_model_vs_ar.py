"""Output tokens/s of the converted default (SmolLM2-135M-Instruct as block diffusion,
served by the plugin) against the original SmolLM2-135M-Instruct decoded by stock vLLM,
on equal work, both float32 and compiled (``--eager`` for both eager).

Each round opens the plugin's engine, answers every prompt set at every batch size (stop
token or ``--max-tokens``), then stock vLLM on the original generates, per request,
exactly as many tokens as the plugin did (``ignore_eos``). For batch b, b greedy chat
requests are submitted at once, repeated until ``--min-requests`` have run. Prompt sets:
``eval`` (the real model's evaluation set, ``real_model/evaluation_set.py``, definite and
open interleaved) and ``chat`` (the project's chat prompt set,
``quality/chat_set.py``). Reported: median tokens/s over ``--rounds`` rounds (each round
kept), the ratio to autoregressive, rows computed per committed token (prompt and commits
included; for AR, prompt plus output per output token) and tokens per denoising step.

    python benchmarks/real_model_vs_ar.py [--batch-sizes 1 4 16 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import harness

SETS = ("eval", "chat")


def prompt_set(name: str) -> list[str]:
    if name == "chat":
        from vllm_diffusion_lab.quality.chat_set import OTHER_KIND_PROMPTS
        return list(OTHER_KIND_PROMPTS)
    from vllm_diffusion_lab.real_model.evaluation_set import DEFINITE_QUESTIONS, OPEN_REQUESTS
    definite = [q.prompt for q in DEFINITE_QUESTIONS]
    return [p for pair in zip(definite, OPEN_REQUESTS) for p in pair]


def run_batches(llm, prompts: list, batch: int, min_requests: int, max_tokens: int,
                lengths: list[int] | None, diffusion: bool) -> dict:
    """``lengths``: equal work (the AR side), else the plugin stops at the stop token."""
    from vllm import SamplingParams

    before = harness.diffusion_counters(llm) if diffusion else None
    done = tokens = prompt_tokens = 0
    produced: list[int] = []
    start = time.perf_counter()
    while done < max(min_requests, batch):
        chunk = [prompts[(done + i) % len(prompts)] for i in range(batch)]
        params = ([SamplingParams(temperature=0, max_tokens=max_tokens)] * batch
                  if lengths is None else
                  [SamplingParams(temperature=0, max_tokens=max(lengths[done + i], 1),
                                  ignore_eos=True) for i in range(batch)])
        for out in llm.generate(chunk, params, use_tqdm=False):
            produced.append(len(out.outputs[0].token_ids))
            tokens += produced[-1]
            prompt_tokens += len(out.prompt_token_ids)
        done += batch
    wall = time.perf_counter() - start
    result = {"tokens_per_s": tokens / wall, "output_tokens": tokens / done,
              "lengths": produced, "seconds": wall}
    if diffusion:
        from vllm_diffusion_lab.offline import stats_delta
        stats = stats_delta(before, harness.diffusion_counters(llm))
        result["rows_per_committed_token"] = stats["all_positions_per_committed_token"]
        result["tokens_per_step"] = stats["tokens_committed_per_denoising_step"]
    else:
        result["rows_per_committed_token"] = (prompt_tokens + tokens) / max(tokens, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_options(parser, out="results/real_model_vs_ar.json",
                               batch_sizes=(1, 4, 16, 64), rounds=3, max_tokens=128)
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--options", default="{}", help="plugin options (JSON)")
    parser.add_argument("--eager", action="store_true", help="both sides eager")
    args = parser.parse_args()
    harness.engines_in_process()
    from transformers import AutoTokenizer

    from vllm_diffusion_lab.offline import autoregressive_llm, diffusion_llm
    from vllm_diffusion_lab.real_model import original_checkpoint
    from vllm_diffusion_lab.real_model.converted import build_converted
    from vllm_diffusion_lab.real_model.evaluation import chat_prompt_ids

    model = args.model or str(build_converted())
    original = original_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(original)
    workloads = {s: [{"prompt_token_ids": ids}
                     for ids in chat_prompt_ids(tokenizer, prompt_set(s))] for s in args.sets}
    options = json.loads(args.options)
    widest = max(args.batch_sizes)
    cells: dict[tuple[str, str, int], list[dict]] = {}
    for index in range(args.rounds):
        recorded: dict[tuple[str, int], list[int]] = {}
        for side in ("plugin", "autoregressive"):
            start = time.perf_counter()
            opened = (diffusion_llm(model, max_model_len=1024, max_num_seqs=widest,
                                    enforce_eager=args.eager, additional_config=options)
                      if side == "plugin" else
                      autoregressive_llm(original, max_num_seqs=widest,
                                         enforce_eager=args.eager))
            with opened as llm:
                run_batches(llm, workloads[args.sets[0]], 1, 1, 8, None,
                            side == "plugin")  # warm-up
                for name in args.sets:
                    for batch in args.batch_sizes:
                        lengths = recorded.get((name, batch)) if side != "plugin" else None
                        result = run_batches(llm, workloads[name], batch, args.min_requests,
                                             args.max_tokens, lengths, side == "plugin")
                        produced = result.pop("lengths")
                        if side == "plugin":
                            recorded[(name, batch)] = produced
                        cells.setdefault((side, name, batch), []).append(result)
            print(f"round {index + 1}/{args.rounds}: {side} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    rows = []
    for name in args.sets:
        for batch in args.batch_sizes:
            ar = statistics.median(r["tokens_per_s"]
                                   for r in cells[("autoregressive", name, batch)])
            for side in ("plugin", "autoregressive"):
                runs = cells[(side, name, batch)]
                row = harness.speed_row(f"{side} ({name})", batch, runs,
                                        ar if side == "plugin" else None)
                row["prompt_set"] = name
                if side == "plugin":
                    row["tokens_per_step"] = statistics.mean(r["tokens_per_step"] for r in runs)
                    row["ratio_each_round"] = [
                        p["tokens_per_s"] / a["tokens_per_s"]
                        for p, a in zip(runs, cells[("autoregressive", name, batch)])]
                rows.append(row)
    report = {"machine": "2-core CPU", "model": model, "original": str(original),
              "options": options, "compiled": not args.eager, "rounds": args.rounds,
              "max_tokens": args.max_tokens, "min_requests": args.min_requests, "rows": rows}
    harness.write_report(report, args.out, lambda r, p: harness.plot_speed_and_rows(
        r, p, dashed=lambda label: label.startswith("autoregressive")))
    print("| set | batch | plugin tok/s | AR tok/s | ratio | rounds | tokens/step | rows/token |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.sets:
        for batch in args.batch_sizes:
            p = next(r for r in rows if r["config"] == f"plugin ({name})"
                     and r["batch_size"] == batch)
            a = next(r for r in rows if r["config"] == f"autoregressive ({name})"
                     and r["batch_size"] == batch)
            print(f"| {name} | {batch} | {p['tokens_per_s']:.1f} | {a['tokens_per_s']:.1f} | "
                  f"{p['ratio_to_autoregressive']:.2f} | "
                  f"{' / '.join(f'{x:.2f}' for x in p['ratio_each_round'])} | "
                  f"{p['tokens_per_step']:.2f} | {p['rows_per_committed_token']:.2f} |")


if __name__ == "__main__":
    main()
