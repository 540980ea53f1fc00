"""What bad words cost a request, and a short request beside it: the bad-words stage's
plain loops over every word and offset against its index (``worker/bad_words.py``).

One in-process eager engine on the embedded model (greedy, ``ignore_eos``), its bad-word
limits raised so that the old hostile request is admitted. Cases, each timed as the wall
time of its requests (vLLM's tokenization of the bad words included):

- ``plain``: a request without bad words (``--max-tokens``);
- ``at_limit``: the same request with as many, as long bad words as the default limits
  admit (``diffusion_max_bad_words`` words whose tokenizations together hold at most
  ``diffusion_max_bad_word_tokens`` tokens; random letters, seeded);
- ``hostile``: the same request with ``--hostile-words`` words of ``--hostile-chars``
  characters each (64 of 100 KB: what a hostile client sent before the limits);
- ``short_alone``, ``short_beside_at_limit``, ``short_beside_hostile``: a short request
  (``--short-max-tokens``) alone, and added right after the bad-words request (both then
  run in the same steps): the time from adding the short one to its end.

Each case runs with the index (``indexed``, the engine's code) and with the plain loops
patched in (``plain_loops``: the code before the index, same results), alternating in
rounds; the report gives the medians, each case's ratio to ``plain`` (or
``short_alone``), and the time spent inside the matching functions (less exposed to a
busy machine than the wall time). JSON to ``--out``, its PNG beside it.

    python benchmarks/bad_words_cost.py [--rounds 3] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import random
import statistics
import string
import time

import harness

MATCHINGS = ("indexed", "plain_loops")
CASES = ("plain", "at_limit", "hostile", "short_alone", "short_beside_at_limit",
         "short_beside_hostile")
BASELINE = {"at_limit": "plain", "hostile": "plain", "short_beside_at_limit": "short_alone",
            "short_beside_hostile": "short_alone"}


_INDEXED: dict = {}  # the engine's own functions, kept before the first patch
MATCHING_SECONDS = [0.0]  # time spent in the bad-words matching since the last reset


def timed(function):
    def run(*args):
        start = time.perf_counter()
        try:
            return function(*args)
        finally:
            MATCHING_SECONDS[0] += time.perf_counter() - start

    return run


def use_matching(matching: str) -> None:
    """Point the bad-words call sites at the index or at the plain loops, timed."""
    from vllm_diffusion.worker import bad_words, constraints, proposal

    indexed = _INDEXED.setdefault("functions", (bad_words.barred_tokens,
                                                bad_words.positions_to_undo))
    plain = (bad_words.barred_tokens_plain, bad_words.positions_to_undo_plain)
    barred, undo = plain if matching == "plain_loops" else indexed
    proposal.barred_tokens = constraints.barred_tokens = timed(barred)
    bad_words.positions_to_undo = timed(undo)  # what undo_completed_words calls


def random_words(count: int, chars: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(string.ascii_lowercase, k=chars)) for _ in range(count)]


def tokenized(words: list[str], tokenizer) -> list[list[int]]:
    """vLLM's tokenizations of ``words`` (each with and without a leading space)."""
    from vllm import SamplingParams

    params = SamplingParams(bad_words=words)
    params.update_from_tokenizer(tokenizer)
    return params.bad_words_token_ids


def words_at_the_limits(tokenizer) -> list[str]:
    """The default limits' count of words, each as long as the token limit allows."""
    from vllm_diffusion.request_limits import RequestLimits

    limits = RequestLimits()
    low, high = 1, 4 * limits.max_bad_word_tokens
    while low < high:  # the longest words whose tokenizations fit
        chars = (low + high + 1) // 2
        words = random_words(limits.max_bad_words, chars, seed=1)
        fits = sum(map(len, tokenized(words, tokenizer))) <= limits.max_bad_word_tokens
        low, high = (chars, high) if fits else (low, chars - 1)
    return random_words(limits.max_bad_words, low, seed=1)


def run_together(llm, requests: list[tuple[str, object]]) -> dict[int, float]:
    """The requests added one after the other, then stepped together; the seconds from
    adding each (vLLM's admission, bad words' tokenization included) to its end."""
    engine = llm.llm_engine
    added = {}
    for index, (prompt, params) in enumerate(requests):
        added[index] = time.perf_counter()
        engine.add_request(str(index), prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                index = int(output.request_id)
                finished[index] = time.perf_counter() - added[index]
    return finished


def measure(args) -> dict:
    from vllm import SamplingParams

    from vllm_diffusion_lab.offline import diffusion_llm
    from vllm_diffusion_lab.quality.corpus import mixed_eval_examples
    from vllm_diffusion_lab.quality.harness import chat_prompts

    use_matching("indexed")
    engine = {"diffusion_max_bad_word_tokens": 1 << 24,
              "diffusion_max_bad_words": max(64, args.hostile_words)}
    with diffusion_llm(harness.model_path(args), max_model_len=args.max_model_len,
                       max_num_seqs=4, additional_config=engine) as llm:
        tokenizer = llm.get_tokenizer()
        prompt = chat_prompts(tokenizer, mixed_eval_examples(1))[0]
        words = {"at_limit": words_at_the_limits(tokenizer),
                 "hostile": random_words(args.hostile_words, args.hostile_chars, seed=2)}
        sizes = {}
        for name, chosen in words.items():
            start = time.perf_counter()
            tokens = sum(map(len, tokenized(chosen, tokenizer)))
            sizes[name] = {"words": len(chosen), "chars_per_word": len(chosen[0]),
                           "tokens": tokens, "tokenize_seconds": time.perf_counter() - start}

        def params(max_tokens: int, bad: list[str] | None = None) -> SamplingParams:
            return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                  bad_words=bad)

        def case(name: str) -> float:
            if name.startswith("short_beside_"):
                bad = words[name.removeprefix("short_beside_")]
                times = run_together(llm, [(prompt, params(args.max_tokens, bad)),
                                           (prompt, params(args.short_max_tokens))])
                return times[1]
            if name == "short_alone":
                return run_together(llm, [(prompt, params(args.short_max_tokens))])[0]
            return run_together(llm, [(prompt, params(args.max_tokens, words.get(name)))])[0]

        run_together(llm, [(prompt, params(args.max_tokens))])  # warm-up
        configs = [f"{matching}/{name}" for matching in args.matchings for name in CASES]

        def run(config: str) -> dict:
            matching, name = config.split("/")
            use_matching(matching)
            MATCHING_SECONDS[0] = 0.0
            seconds = case(name)
            return {"seconds": seconds, "matching_seconds": MATCHING_SECONDS[0]}

        rounds = harness.alternate(configs, args.rounds, run, swap=True)
        use_matching("indexed")
    return {"sizes": sizes, "rounds": rounds}


def summarise(measured: dict, args) -> dict:
    report = {"model": harness.model_path(args), "max_tokens": args.max_tokens,
              "short_max_tokens": args.short_max_tokens, "rounds": args.rounds,
              "sizes": measured["sizes"], "matchings": {}}
    for matching in args.matchings:
        runs = {name: measured["rounds"][f"{matching}/{name}"] for name in CASES}
        seconds = {name: statistics.median(r["seconds"] for r in runs[name]) for name in CASES}
        report["matchings"][matching] = {
            "median_seconds": seconds,
            # in the matching functions (the whole run's, the short request's included)
            "median_matching_seconds": {
                name: statistics.median(r["matching_seconds"] for r in runs[name])
                for name in CASES},
            "each_round": runs,
            "ratios": {name: harness.ratio(seconds[name], seconds[base])
                       for name, base in BASELINE.items()},
        }
    return report


def bars(ax, report: dict, key: str, names: list[str], labels: list[str]) -> None:
    """One group of bars per case, one bar per matching, with its value."""
    width = 0.8 / len(report["matchings"])
    for offset, (matching, result) in enumerate(report["matchings"].items()):
        values = [max(result[key][name], 1e-6) for name in names]
        drawn = ax.bar([i + offset * width for i in range(len(names))], values, width,
                       label=matching)
        ax.bar_label(drawn, fmt="%.3g", fontsize=7)
    ax.set_xticks([i + width * (len(report["matchings"]) - 1) / 2 for i in range(len(names))],
                  labels, fontsize=7)
    ax.set_yscale("log")
    ax.legend(fontsize=7)


def plot(report: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hostile = report["sizes"]["hostile"]
    fig, (ratios, inside) = plt.subplots(1, 2, figsize=(12, 4.2))
    bars(ratios, report, "ratios", list(BASELINE),
         [f"{name}\n/ {base}" for name, base in BASELINE.items()])
    ratios.axhline(1.0, color="grey", linewidth=0.8)
    ratios.set(ylabel="wall time / time without bad words",
               title=f"max_tokens {report['max_tokens']}, hostile: {hostile['words']} x "
                     f"{hostile['chars_per_word']} chars")
    named = [name for name in CASES if name not in ("plain", "short_alone")]
    bars(inside, report, "median_matching_seconds", named, named)
    inside.set(ylabel="seconds in the bad-words matching", title="time inside the matching")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_options(parser, out="results/bad_words_cost.json", rounds=3,
                               max_tokens=64)
    parser.add_argument("--short-max-tokens", type=int, default=16)
    parser.add_argument("--hostile-words", type=int, default=64)
    parser.add_argument("--hostile-chars", type=int, default=100_000)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--matchings", nargs="+", choices=MATCHINGS, default=list(MATCHINGS))
    args = parser.parse_args()
    harness.engines_in_process()
    report = summarise(measure(args), args)
    harness.write_report(report, args.out, plot)
    for matching, result in report["matchings"].items():
        ratios = ", ".join(f"{name} {value:.2f}x" for name, value in result["ratios"].items())
        inside = ", ".join(f"{name} {value:.3g} s" for name, value
                           in result["median_matching_seconds"].items() if value)
        print(f"{matching}: {ratios}; in the matching: {inside}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
