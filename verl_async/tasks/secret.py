"""Secret-digit prompts for the tiny model, the data of ``envs.secret.SecretEnv``.

    python -m verl_async.tasks.secret   # writes configs/data/secret{,_val}.jsonl

Every row is the same prompt, "secret =", with a digit 0..9 drawn at random as its answer
(plain layout: ``prompt``, ``answer``, ``data_source`` "secret"). Only the environment's
``lookup`` tool tells it, so what a policy can learn is to call the tool and copy what it
answers.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PROMPT = "secret ="
SOURCE = "secret"
TRAIN_SEED, VAL_SEED = 1, 2


def write_dataset(path: Path, n: int, seed: int) -> None:
    """``n`` rows drawn with ``seed``, one JSON object a line."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            row = {"prompt": PROMPT, "answer": str(rng.randint(0, 9)), "data_source": SOURCE}
            f.write(json.dumps(row) + "\n")


def write_files(data_dir: Path, train: int = 512, val: int = 128) -> tuple[Path, Path]:
    """The shipped files in ``data_dir`` (``data.path`` and ``data.val_path``)."""
    train_path, val_path = data_dir / "secret.jsonl", data_dir / "secret_val.jsonl"
    write_dataset(train_path, train, TRAIN_SEED)
    write_dataset(val_path, val, VAL_SEED)
    return train_path, val_path


if __name__ == "__main__":
    write_files(Path("configs/data"))
