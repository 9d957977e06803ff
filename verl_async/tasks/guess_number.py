"""Guess-the-digit prompts for the tiny model, the data of ``envs.guess.GuessNumberEnv``.

    python -m verl_async.tasks.guess_number   # writes configs/data/guess_digit{,_val}.jsonl

Every row is the same prompt, "guess =", with a secret digit 0..9 as the answer (plain
layout: ``prompt``, ``answer``, ``data_source`` "guess", ``extra_info`` {lo: 0, hi: 9}).
The prompt says nothing about the secret: what a policy can learn is a search that uses
the "higher"/"lower" feedback between its turns (binary search needs at most four
guesses). So the validation rows cannot be prompts the training rows lack: they measure
that search, at temperature 0, over secrets drawn with another seed.

The prompt is written in the tiny vocabulary; the feedback needs ``model.tiny.extra_words``
(guess, higher, lower, ...) for the tiny tokenizer to have ids for it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PROMPT = "guess ="
SOURCE = "guess"
LO, HI = 0, 9
TRAIN_SEED, VAL_SEED = 1, 2


def make_record(rng: random.Random) -> dict:
    """One row with a secret drawn from ``rng``."""
    return {
        "prompt": PROMPT,
        "answer": str(rng.randint(LO, HI)),
        "data_source": SOURCE,
        "extra_info": {"lo": LO, "hi": HI},
    }


def write_dataset(path: Path, n: int, seed: int) -> None:
    """``n`` rows drawn with ``seed``, one JSON object a line."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps(make_record(rng)) + "\n")


def write_files(data_dir: Path, train: int = 512, val: int = 128) -> tuple[Path, Path]:
    """The shipped files in ``data_dir``: ``train`` training rows and ``val`` validation
    rows (``data.val_path``), drawn with different seeds."""
    train_path, val_path = data_dir / "guess_digit.jsonl", data_dir / "guess_digit_val.jsonl"
    write_dataset(train_path, train, TRAIN_SEED)
    write_dataset(val_path, val, VAL_SEED)
    return train_path, val_path


if __name__ == "__main__":
    write_files(Path("configs/data"))
