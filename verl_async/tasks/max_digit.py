"""Toy task for the tiny default: answer with the largest digit of the prompt.

Prompt ``max 3 7 1 4 =``, correct response ``7`` (reward 1 when the first word of the
response is the answer, else 0: an ``exact`` reward source with ``extract: first_word``).
A random tiny model is right about 1/16 of the time; always answering ``9`` scores ~0.4;
reading the digits scores 1.0. So the reward curve shows both the easy gain (output bias)
and the real one (attention over the prompt).
"""

from __future__ import annotations

import json
import random
from collections.abc import Set
from pathlib import Path

VOCAB = ["<pad>", "<bos>", "<eos>", "max", "=", *[str(d) for d in range(10)]]


def make_record(rng: random.Random) -> dict[str, str]:
    digits = [rng.randrange(10) for _ in range(rng.randint(3, 6))]
    return {"prompt": "max " + " ".join(map(str, digits)) + " =", "answer": str(max(digits))}


def write_dataset(path: Path, n: int, seed: int = 1234, exclude: Set[str] = frozenset()) -> None:
    """``n`` records drawn with ``seed``, none of whose prompts is in ``exclude``."""
    rng = random.Random(seed)
    written = 0
    with open(path, "w") as f:
        while written < n:
            record = make_record(rng)
            if record["prompt"] not in exclude:
                f.write(json.dumps(record) + "\n")
                written += 1


def write_files(data_dir: Path) -> tuple[Path, Path]:
    """The shipped files in ``data_dir``: 2,048 training prompts and 512 held out for
    evaluation (``data.val_path``), drawn with another seed and none a training prompt."""
    train, val = data_dir / "max_digit.jsonl", data_dir / "max_digit_val.jsonl"
    write_dataset(train, 2048)
    seen = {json.loads(line)["prompt"] for line in train.open()}
    write_dataset(val, 512, seed=4321, exclude=seen)
    return train, val


if __name__ == "__main__":
    write_files(Path("configs/data"))
