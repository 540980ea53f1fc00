"""Instructor-style JSON extraction through ``vllm serve`` with the OpenAI client.

As instructor's JSON-schema mode does: a pydantic model's JSON schema goes out as the chat
request's ``response_format`` json_schema, and a try succeeds when the answer validates
into the model (``model_validate_json``; instructor would otherwise retry). Two tasks, 20
tries each (20 different inputs, greedy, one request per try, all at once): a two-field
object (``Person``: name, age, from "Mia is 7 years old.") and a three-item list
(``Items``: exactly three strings, from "apples, pears and plums."). The server runs the
embedded SDAR model (or ``--model``) with its own defaults, once with compact JSON (the plugin's
default) and once with ``diffusion_json_any_whitespace`` (what vLLM's default
structured-output settings give), one server at a time.

    python benchmarks/json_extraction.py
writes results/json_extraction.json: per setting and task, successes out of the tries,
finish reasons, and a few answers that did not validate.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json

import harness
from pydantic import BaseModel, Field, ValidationError

NAMES = ["Mia", "Leo", "Ava", "Noah", "Emma", "Liam", "Zoe", "Omar", "Ines", "Hugo",
         "Sara", "Ivan", "Lena", "Tom", "Nora", "Finn", "Ella", "Jack", "Rosa", "Max"]
TRIPLES = [("apples", "pears", "plums"), ("red", "green", "blue"), ("cats", "dogs", "owls"),
           ("Peru", "Chile", "Spain"), ("beans", "peas", "corn"), ("gold", "iron", "tin"),
           ("Mars", "Venus", "Earth"), ("roses", "tulips", "lilies"), ("tea", "milk", "juice"),
           ("oak", "pine", "elm"), ("chess", "golf", "tennis"), ("salt", "sugar", "flour"),
           ("Paris", "Rome", "Oslo"), ("hammer", "saw", "drill"), ("piano", "flute", "drum"),
           ("bread", "rice", "soup"), ("Monday", "Friday", "Sunday"), ("bees", "ants", "moths"),
           ("rain", "snow", "wind"), ("boats", "trains", "cars")]
MAX_TOKENS = {"object": 64, "list": 96}


class Person(BaseModel):
    name: str
    age: int


class Items(BaseModel):
    items: list[str] = Field(min_length=3, max_length=3)


def tries() -> dict[str, list[tuple[str, type[BaseModel]]]]:
    """Per task, its 20 (prompt, model) tries."""
    return {
        "object": [(f"Extract the person as JSON: {name} is {age} years old.", Person)
                   for name, age in zip(NAMES, range(7, 47, 2))],
        "list": [(f"Extract the three items as JSON: {a}, {b} and {c}.", Items)
                 for a, b, c in TRIPLES],
    }


def extract(client, model: str, prompt: str, schema: type[BaseModel],
            max_tokens: int) -> tuple[bool, str, str]:
    """One try: (it validated, finish reason, the answer)."""
    response = client.chat.completions.create(
        model=model, temperature=0, max_tokens=max_tokens,
        messages=[{"role": "user", "content": prompt}],
        response_format={"type": "json_schema", "json_schema": {
            "name": schema.__name__, "schema": schema.model_json_schema()}})
    choice = response.choices[0]
    text = choice.message.content or ""
    try:
        schema.model_validate_json(text)
        return True, choice.finish_reason, text
    except ValidationError:
        return False, choice.finish_reason, text


def run_setting(model: str, any_whitespace: bool) -> dict:
    from openai import OpenAI

    from vllm_diffusion_lab.fixtures.server import vllm_server

    extra = {"diffusion_json_any_whitespace": any_whitespace}
    with vllm_server(model, "--max-model-len", "512", "--max-num-seqs", "20",
                     "--additional-config", json.dumps(extra)) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600)
        report = {}
        for task, task_tries in tries().items():
            with concurrent.futures.ThreadPoolExecutor(len(task_tries)) as pool:
                answers = list(pool.map(
                    lambda t, limit=MAX_TOKENS[task]: extract(client, model, *t, limit),
                    task_tries))
            reasons: dict[str, int] = {}
            for _, reason, _ in answers:
                reasons[reason] = reasons.get(reason, 0) + 1
            report[task] = {"successes": sum(ok for ok, _, _ in answers),
                            "tries": len(answers), "finish_reasons": reasons,
                            "failed_answers": [text for ok, _, text in answers if not ok][:3]}
            print(("any whitespace" if any_whitespace else "compact"), task,
                  json.dumps(report[task]), flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_options(parser, out="results/json_extraction.json")
    args = parser.parse_args()
    model = harness.model_path(args)
    report = {"model": model, "settings": {}}
    for name, any_whitespace in (("any whitespace", True), ("compact (default)", False)):
        report["settings"][name] = run_setting(model, any_whitespace)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
