"""Does the importance delta predict which masked tokens get decoded? (FOCUS Fig. 4 / 13)

During standard decoding of the evaluation split, the engine records for every masked
position at every step the importance delta (I(layer 1) - I(layer 0), FOCUS Eq. 2-3), the
raw layer-1 importance, and whether the position was decoded that step. Each score is
turned into a percentile rank among the candidates of its own step (the ranking FOCUS
selects by); the report gives the decode rate and the share of decoded tokens per
percentile bin, and the ROC AUC of each score as a predictor of decoding: over all
candidates, over the answer's own positions only (``answer_positions``: up to the
answer's end token; the block positions after it decode as end-of-text filler, in bulk),
and over hard steps (at least 8 candidates, at most 3 decoded), next to a leftmost-first
baseline (a candidate's negated position).

On the default model (SmolLM2 converted in Fast-dLLM v2's form) the prompts are the real
model's evaluation set (``real_model/evaluation_set.py``: definite questions and open
requests, alternating); on a toy checkpoint (``--model``) the quality corpus's chat
prompts. Where the model's logits are shifted, a masked position's token is read from the
row before it, and the recorded importance is that row's (the row that decodes the
position; the runner hands the hooks those rows as the block's candidate rows).

    python benchmarks/decodability_study.py [--block-size 8] [--limit 96]
    python benchmarks/decodability_study.py --model checkpoints/sdar-small-chat --block-size 32
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

import numpy as np

BINS = (0, 20, 40, 60, 80, 100)


def percentile_ranks(values: list[float]) -> np.ndarray:
    """Rank of each value among its step's candidates, in [0, 100] (ties averaged)."""
    array = np.asarray(values)
    order = array.argsort(kind="stable")
    ranks = np.empty(len(array))
    ranks[order] = np.arange(len(array))
    for value in np.unique(array):  # average ranks of ties
        tied = array == value
        ranks[tied] = ranks[tied].mean()
    return 100.0 * ranks / (len(array) - 1)


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Probability that a decoded position outranks a non-decoded one (Mann-Whitney U)."""
    positives, negatives = scores[labels], scores[~labels]
    if len(positives) == 0 or len(negatives) == 0:
        return float("nan")
    order = np.concatenate([positives, negatives]).argsort(kind="stable")
    ranks = np.empty(len(order))
    ranks[order] = np.arange(1, len(order) + 1)
    combined = np.concatenate([positives, negatives])
    for value in np.unique(combined):
        tied = combined == value
        ranks[tied] = ranks[tied].mean()
    u = ranks[:len(positives)].sum() - len(positives) * (len(positives) + 1) / 2
    return float(u / (len(positives) * len(negatives)))


# Scores of each candidate: FOCUS's delta, raw layer-1 importance, and a leftmost-first
# baseline (the negated position: the leftmost masked position ranks highest).
METRICS = ("delta", "layer1", "leftmost")


def metric_scores(record: dict[str, list], metric: str) -> list[float]:
    if metric == "leftmost":
        return [-float(p) for p in record["positions"]]
    return record[metric]


def is_hard(record: dict[str, list]) -> bool:
    """A hard step: at least 8 candidates, at most 3 of them decoded."""
    return len(record["decoded"]) >= 8 and sum(record["decoded"]) <= 3


def analyse(records: list[dict[str, list]], hard_steps: bool = True) -> dict:
    steps = [r for r in records if len(r["decoded"]) > 1]
    decoded = np.concatenate([np.asarray(r["decoded"], dtype=bool) for r in steps])
    report = {"steps": len(steps), "candidates": int(len(decoded)),
              "decoded": int(decoded.sum()), "base_decode_rate": float(decoded.mean())}
    for metric in METRICS:
        ranks = np.concatenate([percentile_ranks(metric_scores(r, metric)) for r in steps])
        raw = np.concatenate([np.asarray(metric_scores(r, metric)) for r in steps])
        bins = []
        for low, high in zip(BINS[:-1], BINS[1:]):
            inside = (ranks >= low) & ((ranks < high) if high < 100 else (ranks <= high))
            bins.append({"bin": f"[{low}, {high}{']' if high == 100 else ')'}",
                         "candidates": int(inside.sum()),
                         "decode_rate": float(decoded[inside].mean()) if inside.any() else None,
                         "share_of_decoded": float(decoded[inside].sum() / max(decoded.sum(), 1))})
        report[metric] = {"auc_within_step_rank": roc_auc(ranks, decoded),
                          "auc_raw": roc_auc(raw, decoded), "bins": bins}
    if hard_steps:
        hard = [r for r in steps if is_hard(r)]
        report["hard_steps"] = analyse(hard, hard_steps=False) if hard else None
    return report


def answer_positions_only(records: list[dict], answer_ends: dict[str, int]) -> list[dict]:
    """The records cut to candidates before each request's answer end (an absolute position).

    The runner knows engine request ids (the ``LLM`` id plus a suffix vLLM appends)."""
    kept = []
    for record in records:
        request = record["req_id"].rsplit("-", 1)[0]
        if request not in answer_ends:
            raise KeyError(f"no output for engine request {record['req_id']!r}")
        inside = [i for i, p in enumerate(record["positions"]) if p < answer_ends[request]]
        kept.append({key: [record[key][i] for i in inside]
                     for key in ("positions", "delta", "layer1", "decoded")})
    return kept


def parts(report: dict) -> tuple[tuple[dict, str], ...]:
    """The two analyses of a report, with their labels."""
    return (report, "all candidates"), (report["answer_positions"], "answer positions")


def print_report(report: dict) -> None:
    """Each analysis of a report: its counts, and each metric's AUC and decode rate by bin."""
    for part, label in (*parts(report), (report.get("hard_steps"), "hard steps")):
        if part is None:
            print(f"{label}: none")
            continue
        print(f"{label}: " + json.dumps({k: v for k, v in part.items()
                                          if k in ("steps", "candidates", "decoded", "base_decode_rate")}))
        for metric in METRICS:
            print(f"  {metric} AUC {part[metric]['auc_within_step_rank']:.3f}, decode rate by bin",
                  [b["decode_rate"] and round(b["decode_rate"], 3) for b in part[metric]["bins"]])


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharey=True)
    for row, (part, label) in zip(axes, parts(report)):
        for ax, metric, title in zip(row, ("delta", "layer1"),
                                     ("importance delta I1 - I0", "raw layer-1 importance")):
            bins = part[metric]["bins"]
            ax.bar([b["bin"] for b in bins], [b["decode_rate"] or 0.0 for b in bins],
                   color="tab:green")
            ax.axhline(part["base_decode_rate"], color="grey", linestyle="--", label="mean")
            ax.set_title(f"{title}, {label}\nAUC {part[metric]['auc_within_step_rank']:.3f}")
            ax.set_xlabel("percentile within step")
        row[0].set_ylabel("decoded this step")
    axes[0][0].legend()
    fig.suptitle(f"Decodability vs importance ({report['model_name']}, block {report['block_size']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def study_prompts(tokenizer, args) -> list:
    """The default model's evaluation prompts (definite and open alternating, ``--limit``
    in all), or a toy's quality-corpus chat prompts."""
    from vllm import TokensPrompt

    if args.model is not None:
        from vllm_diffusion_lab.quality.corpus import eval_examples
        from vllm_diffusion_lab.quality.harness import chat_prompts

        return chat_prompts(tokenizer, eval_examples(args.per_family))
    from vllm_diffusion_lab.real_model.evaluation import chat_prompt_ids
    from vllm_diffusion_lab.real_model.evaluation_set import DEFINITE_QUESTIONS, OPEN_REQUESTS

    half = args.limit // 2
    texts = [q.prompt for q in DEFINITE_QUESTIONS[:args.limit - half]] + list(
        OPEN_REQUESTS[:half])
    return [TokensPrompt(prompt_token_ids=ids) for ids in chat_prompt_ids(tokenizer, texts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="a toy checkpoint (default: the converted SmolLM2 default)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="default: the checkpoint's (32 for a toy)")
    parser.add_argument("--per-family", type=int, default=20, help="toy prompts per family")
    parser.add_argument("--limit", type=int, default=96,
                        help="evaluation prompts of the default model (half definite)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--out", default="results/decodability.json")
    parser.add_argument("--plot", default="results/decodability.png")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    from vllm import LLM, SamplingParams

    from vllm_diffusion.default_model import default_model_path
    from vllm_diffusion_lab.recording import start_importance_recording, take_importance_records

    model = args.model or str(default_model_path())
    block_size = args.block_size or (None if args.model is None else 32)
    config = {"threshold": args.threshold}
    if block_size is not None:
        config["diffusion_block_size"] = block_size
    llm = LLM(model=model, dtype="float32", enforce_eager=True, seed=0, max_model_len=1024,
              additional_config=config)
    prompts = study_prompts(llm.get_tokenizer(), args)
    start_importance_recording(llm)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens),
                           use_tqdm=False)
    records = take_importance_records(llm)
    answer_ends = {o.request_id: len(o.prompt_token_ids) + len(o.outputs[0].token_ids)
                   for o in outputs}
    if block_size is None:  # the converted checkpoint's own
        block_size = json.loads((pathlib.Path(model) / "config.json").read_text())["bd_size"]
    report = {"model": model, "model_name": pathlib.Path(model).name,
              "block_size": block_size, "max_tokens": args.max_tokens, "threshold": args.threshold,
              "prompts": len(prompts), **analyse(records),
              "answer_positions": analyse(answer_positions_only(records, answer_ends))}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, pathlib.Path(args.plot))
    print_report(report)

if __name__ == "__main__":
    main()
