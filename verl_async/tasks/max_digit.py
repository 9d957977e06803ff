"""Toy task for the tiny default: answer with the largest digit of the prompt.

Prompt ``max 3 7 1 4 =``, correct response ``7`` (reward 1 when the first word of the
response is the answer, else 0: an ``exact`` reward source with ``extract: first_word``). A random tiny model is right about 1/16 of the time;
always answering ``9`` scores ~0.4; reading the digits scores 1.0. So the reward curve
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


def write_dataset(path: Path, n: int, seed: int = 1234) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps(make_record(rng)) + "\n")


if __name__ == "__main__":
    write_dataset(Path("configs/data/max_digit.jsonl"), 2048)
