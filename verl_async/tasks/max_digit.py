"""Toy task for the tiny default: answer with the largest digit of the prompt.

Prompt ``max 3 7 1 4 =``, correct response ``7`` (reward 1 when the first word of the
response is the answer, else 0: an ``exact`` reward source with ``extract: first_word``).
A random tiny model is right about 1/16 of the time; always answering ``9`` scores ~0.4;
reading the digits scores 1.0. So the reward curve
shows both the easy gain (output bias) and the real one (attention over the prompt).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

VOCAB = ["<pad>", "<bos>", "<eos>", "max", "=", *[str(d) for d in range(10)]]


def make_record(rng: random.Random) -> dict[str, str]:
    digits = [rng.randrange(10) for _ in range(rng.randint(3, 6))]
    return {"prompt": "max " + " ".join(map(str, digits)) + " =", "answer": str(max(digits))}


def write_dataset(path: Path, n: int, seed: int = 1234, exclude: set[str] = frozenset()) -> None:
    """``n`` records drawn with ``seed``, none of whose prompts is in ``exclude``."""
    rng = random.Random(seed)
    written = 0
    with open(path, "w") as f:
        while written < n:
            record = make_record(rng)
            if record["prompt"] not in exclude:
                f.write(json.dumps(record) + "\n")
                written += 1


if __name__ == "__main__":
    train = Path("configs/data/max_digit.jsonl")
    write_dataset(train, 2048)
    # Held out for evaluation (data.val_path): another seed, no training prompt.
    seen = {json.loads(line)["prompt"] for line in train.open()}
    write_dataset(Path("configs/data/max_digit_val.jsonl"), 512, seed=4321, exclude=seen)
