"""GSM8K in verl's Parquet layout, for machines that can reach the Hugging Face hub.

    python -m verl_async.tasks.gsm8k OUT_DIR      # writes OUT_DIR/train.parquet, test.parquet

Each row: ``prompt`` = one user message (the question plus an instruction to end with
``#### <answer>``), ``data_source`` = "openai/gsm8k", ``reward_model.ground_truth`` = the
number after ``####`` in the reference solution, ``extra_info`` = split, index, the full
reference solution. The ``math`` reward source reads ``#### 72`` and ``\\boxed{72}`` alike.
Needs ``pip install datasets`` and network access (not available in this project's CI,
which is why only ``to_rows`` is tested here).
"""

from __future__ import annotations

import argparse
from pathlib import Path

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SOURCE = "openai/gsm8k"


def final_answer(solution: str) -> str:
    """The reference number: what follows the last ``####``, without thousands separators."""
    if "####" not in solution:
        raise ValueError("a GSM8K solution ends with '#### <answer>'")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def to_rows(examples: list[dict], split: str) -> list[dict]:
    """GSM8K examples (``question``, ``answer``) as rows of verl's layout."""
    return [
        {
            "prompt": [{"role": "user", "content": f"{ex['question']} {INSTRUCTION}"}],
            "data_source": SOURCE,
            "reward_model": {"ground_truth": final_answer(ex["answer"]), "style": "rule"},
            "extra_info": {"split": split, "index": i, "solution": ex["answer"]},
        }
        for i, ex in enumerate(examples)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    args = parser.parse_args()
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import load_dataset

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = load_dataset(SOURCE, "main")
    for split in ("train", "test"):
        rows = to_rows(list(data[split]), split)
        pq.write_table(pa.Table.from_pylist(rows), out / f"{split}.parquet")
        print(f"{out / f'{split}.parquet'}: {len(rows)} rows")


if __name__ == "__main__":
    main()
