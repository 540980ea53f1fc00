"""Structured output on the embedded model: JSON-schema requests on its JSON task.

Held-out problems of the quality corpus's ``json`` family ("Write a compact JSON object
with name: Mia; age: 7."), each with a schema of its two to four typed fields (all
required, no others), in the model's chat template; greedy, ``max_tokens`` 64. Runs, one
engine at a time: the plugin (``standard``, block 16) without and with the schema, then
stock vLLM decoding the same weights autoregressively, without and with the schema (its
outputs are noise of a different kind: compare validity, ``length`` rates and overhead,
not answers). Per run: finish reasons, the share of outputs that parse and validate, exact
matches, tokens per denoising step (plugin), matcher calls per step, wall time and the
grammar's share of it (plugin, ``step_timing.StepClock``; batches of up to 32 requests).

    python benchmarks/structured_output.py --problems 60
writes results/structured_output.json. With ``--served`` the schema requests go through
``vllm serve`` instead (chat completions with ``response_format`` json_schema, 32 at a
time, the model's chat template applied by the server): finish reasons, validity, and
tokens per denoising step from the server's ``/metrics``. The plugin's JSON grammars are
compact by default; ``--json-any-whitespace`` runs it with whitespace allowed between JSON
tokens (``diffusion_json_any_whitespace``, vLLM's default setting).
"""

from __future__ import annotations

import argparse
import json
import time

import harness
from step_timing import StepClock


def schema_of(answer: str) -> dict:
    fields = json.loads(answer)
    return {"type": "object",
            "properties": {k: {"type": "integer" if isinstance(v, int) else "string"}
                           for k, v in fields.items()},
            "required": list(fields), "additionalProperties": False}


def score(outputs, examples) -> dict:
    import jsonschema

    reasons: dict[str, int] = {}
    valid = exact = 0
    for output, example in zip(outputs, examples):
        choice = output.outputs[0]
        reasons[choice.finish_reason] = reasons.get(choice.finish_reason, 0) + 1
        try:
            value = json.loads(choice.text)
            jsonschema.validate(value, schema_of(example.answer))
            valid += 1
            exact += int(value == json.loads(example.answer))
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    n = len(examples)
    return {"finish_reasons": reasons, "stop_rate": reasons.get("stop", 0) / n,
            "valid_rate": valid / n, "exact_rate": exact / n,
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}


def grammar_clock() -> StepClock:
    """Wall time in the runner's grammar work (the mask at F, the walk, the commit
    restriction, advancing matchers), by wrapping those functions in this process (the
    benchmark's engine runs in-process)."""
    from vllm_diffusion.worker import block_updates, grammar

    clock = StepClock()
    for owner, name in [(grammar.GrammarStep, "first_row_masks"),
                        (grammar.GrammarStep, "constrain"), (grammar.GrammarStep, "restrict"),
                        (block_updates, "advance")]:
        clock.wrap(owner, name, "grammar")
    return clock


def run(llm, examples, with_schema: bool, diffusion: bool,
        clock: StepClock | None = None) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_diffusion_lab.quality.harness import chat_prompts

    prompts = chat_prompts(llm.get_tokenizer(), examples)
    params = [SamplingParams(temperature=0, max_tokens=64, structured_outputs=(
        StructuredOutputsParams(json=schema_of(e.answer)) if with_schema else None))
        for e in examples]
    if clock is not None:
        clock.clear()
    generation = harness.generate(llm, prompts, params, counters=diffusion)
    wall = generation.seconds
    result = {"schema": with_schema, "wall_s": round(wall, 3),
              **score(generation.outputs, examples)}
    if clock is not None:
        result["grammar_share_of_wall"] = round(clock.totals["grammar"] / wall, 3)
    result["tokens_per_s"] = round(result["output_tokens"] / wall, 1)
    if diffusion:
        stats = generation.stats
        result["tokens_per_step"] = round(stats["tokens_committed_per_denoising_step"], 3)
        result["denoising_steps"] = stats["denoising_steps"]
        result["matcher_fills_per_step"] = round(
            stats["grammar_fills"] / max(stats["denoising_steps"], 1), 2)
        result["matcher_accepts_per_step"] = round(
            stats["grammar_accepts"] / max(stats["denoising_steps"], 1), 2)
    return result


def metric(url: str, name: str) -> float:
    import re

    import requests

    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$",
                                            text, re.MULTILINE))


def served(model, examples, block_size: int, any_whitespace: bool) -> dict:
    """The schema requests through ``vllm serve`` (standard policy, greedy, 64 tokens)."""
    import concurrent.futures

    import jsonschema
    import requests

    from vllm_diffusion_lab.fixtures.server import vllm_server

    with vllm_server(model, "--diffusion-policy", "standard", "--max-model-len", "512",
                     "--additional-config", json.dumps({
                         "diffusion_block_size": block_size,
                         "diffusion_json_any_whitespace": any_whitespace}),
                     "--max-num-seqs", "32") as url:
        def ask(example):
            body = {"model": str(model), "temperature": 0, "max_tokens": 64,
                    "messages": [{"role": "user", "content": example.prompt}],
                    "response_format": {"type": "json_schema", "json_schema": {
                        "name": "fields", "schema": schema_of(example.answer)}}}
            return requests.post(f"{url}/v1/chat/completions", json=body, timeout=300).json()

        steps = metric(url, "vllm:diffusion_num_denoising_steps_total")
        tokens = metric(url, "vllm:diffusion_num_committed_tokens_total")
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(ask, examples))
        wall = time.perf_counter() - start
        steps = metric(url, "vllm:diffusion_num_denoising_steps_total") - steps
        tokens = metric(url, "vllm:diffusion_num_committed_tokens_total") - tokens
    reasons: dict[str, int] = {}
    valid = stopped_valid = 0
    for answer, example in zip(answers, examples):
        choice = answer["choices"][0]
        reasons[choice["finish_reason"]] = reasons.get(choice["finish_reason"], 0) + 1
        try:
            jsonschema.validate(json.loads(choice["message"]["content"]),
                                schema_of(example.answer))
            valid += 1
            stopped_valid += choice["finish_reason"] == "stop"
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    n = len(examples)
    return {"finish_reasons": reasons, "stop_rate": reasons.get("stop", 0) / n,
            "valid_rate": valid / n,
            "stopped_valid_rate": stopped_valid / max(reasons.get("stop", 0), 1),
            "tokens_per_step": round(tokens / max(steps, 1), 3), "wall_s": round(wall, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=60)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--skip-autoregressive", action="store_true")
    parser.add_argument("--served", action="store_true",
                        help="send the schema requests through vllm serve")
    parser.add_argument("--json-any-whitespace", action="store_true",
                        help="allow whitespace between JSON tokens (the plugin's JSON "
                             "grammars are compact by default)")
    harness.add_common_options(parser, out="results/structured_output.json")
    args = parser.parse_args()
    from vllm_diffusion_lab.offline import autoregressive_llm, diffusion_llm
    from vllm_diffusion_lab.quality.corpus import generate_examples

    examples = generate_examples(args.problems, 17, ("json",), split="eval")
    model = harness.model_path(args)
    report = {"problems": args.problems, "block_size": args.block_size,
              "json_any_whitespace": args.json_any_whitespace, "runs": {}}
    if args.served:
        report["runs"]["served plugin + schema"] = served(model, examples, args.block_size,
                                                          args.json_any_whitespace)
        print(json.dumps(report["runs"]["served plugin + schema"]))
        out = args.out.with_name(args.out.stem + "_served.json")
        out.write_text(json.dumps(report, indent=1) + "\n")
        return
    with diffusion_llm(model, diffusion_block_size=args.block_size, max_model_len=512,
                       max_num_seqs=32, enforce_eager=False, additional_config={
                           "diffusion_json_any_whitespace": args.json_any_whitespace},
                       ) as llm, grammar_clock() as clock:
        for with_schema in (False, True):
            name = f"plugin{' + schema' if with_schema else ''}"
            report["runs"][name] = run(llm, examples, with_schema, diffusion=True,
                                       clock=clock)
            print(name, json.dumps(report["runs"][name]))
    if not args.skip_autoregressive:
        with autoregressive_llm(model, max_model_len=512, max_num_seqs=32) as llm:
            for with_schema in (False, True):
                name = f"autoregressive{' + schema' if with_schema else ''}"
                report["runs"][name] = run(llm, examples, with_schema, diffusion=False)
                print(name, json.dumps(report["runs"][name]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
