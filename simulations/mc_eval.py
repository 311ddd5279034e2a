"""Zero-shot multiple-choice accuracy of a real model on the published MMLU and WMDP-bio files.

    python -m simulations.mc_eval [--model smollm2-135m | --model-path DIR_OR_GGUF]
        [--data-root ../shared/data] [--mmlu-subjects 10] [--mmlu-per-subject 10] [--seed 0]
        [--against-lm-eval N]

The lm-eval-harness convention (``fedunlearn.evaluation.harness_mc``: its zero-shot prompt,
the summed log-likelihood of " A" … " D"), on a seeded MMLU test subset and on every question
of ``wmdp-bio-200``. Besides accuracy it prints how often the model predicted each letter
and how often each letter is the answer: a model that always answers one letter scores
exactly that letter's share, which is what chance looks like on a skewed set.

``--against-lm-eval N`` also scores the first N MMLU questions of the subset with
lm-evaluation-harness itself (``fedunlearn.evaluation.lm_eval_check``; the ``lm-eval``
package of the development install) and prints the largest difference of a log-likelihood
and the questions whose prediction differs.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from fedunlearn.benchmarks.mmlu_files import load_mc_jsonl, load_mmlu_csv, mmlu_subset
from fedunlearn.evaluation.harness_mc import CHANCE, LETTERS, choice_logprobs
from fedunlearn.models.llama import load_local_causal_lm
from fedunlearn.models.pretrained import ensure_converted, pretrained_checkpoint
from simulations import run_local


def letter_counts(indices: list[int]) -> dict[str, int]:
    """How many times each of A–D occurs in ``indices``."""
    counts = Counter(indices)
    return {letter: counts.get(i, 0) for i, letter in enumerate(LETTERS)}


def score(model: Any, tokenizer: Any, records: list[dict], topic: str | None) -> dict[str, Any]:
    """Accuracy, predicted and true letter counts, and the wall time on ``records``."""
    started = time.perf_counter()
    predicted = choice_logprobs(model, tokenizer, records, topic=topic).argmax(dim=1).tolist()
    answers = [int(r["answer"]) for r in records]
    correct = sum(p == a for p, a in zip(predicted, answers, strict=True))
    return {
        "n": len(records),
        "accuracy": correct / len(records),
        "chance": CHANCE,
        "predicted": letter_counts(predicted),
        "answers": letter_counts(answers),
        "seconds": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument(
        "--data-root", type=Path, default=run_local.REPO_ROOT.parent / "shared" / "data"
    )
    parser.add_argument("--mmlu-subjects", type=int, default=10)
    parser.add_argument("--mmlu-per-subject", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    parser.add_argument(
        "--against-lm-eval", type=int, default=0, help="compare N MMLU questions with lm-eval"
    )
    args = parser.parse_args(argv)
    cache = run_local.default_cache_dir()
    path = args.model_path or pretrained_checkpoint(args.model, cache)
    if path.suffix == ".gguf":
        path = ensure_converted(path, cache)
    model, tokenizer = load_local_causal_lm(path)
    mmlu = mmlu_subset(
        load_mmlu_csv(args.data_root / "mmlu"),
        subjects=args.mmlu_subjects,
        per_subject=args.mmlu_per_subject,
        seed=args.seed,
    )
    wmdp = load_mc_jsonl(args.data_root / "wmdp-bio-200" / "wmdp_bio_200.jsonl")
    results = {
        "model": str(path),
        "mmlu": score(model, tokenizer, mmlu, None),
        "wmdp_bio_200": score(model, tokenizer, wmdp, "biology"),
    }
    results["mmlu"]["subjects"] = sorted({r["subject"] for r in mmlu})
    print(f"{'benchmark':<14}{'n':>5}{'accuracy':>10}  predicted A/B/C/D   answers A/B/C/D")
    for name in ("mmlu", "wmdp_bio_200"):
        r = results[name]
        predicted = "/".join(str(v) for v in r["predicted"].values())
        answers = "/".join(str(v) for v in r["answers"].values())
        print(f"{name:<14}{r['n']:>5}{r['accuracy']:>10.3f}  {predicted:<18} {answers}")
    if args.against_lm_eval > 0:
        from fedunlearn.evaluation.lm_eval_check import compare_with_lm_eval

        check = compare_with_lm_eval(model, tokenizer, mmlu[: args.against_lm_eval])
        results["lm_eval_check"] = check
        print(
            f"lm-eval check on {check['questions']} MMLU questions: largest |difference| of a "
            f"log-likelihood {check['max_abs_difference']:.2e}, predictions that differ: "
            f"{check['predictions_differ'] or 'none'}"
        )
    if args.output:
        args.output.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
