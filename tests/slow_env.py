"""An environment whose steps take as long as the test says: episodes that outlive leases.

``SlowEnv`` is ``RetryEnv`` (first word, as on the max-digit task) whose ``step`` sleeps
``sleep_s`` before it answers, so an episode of one turn lasts at least ``sleep_s``
whatever the machine's speed.

With ``first_only_dir`` set, only the first episode of each prompt sleeps, across every
process and every copy of its group: the episode that creates the file named after the
prompt (``zlib.crc32`` of its text, created exclusively, so exactly one episode wins);
later episodes of that prompt, in that copy or a copy issued again, answer at once.

    multiturn:
      environments:
        - env: tests.slow_env:SlowEnv
          args: {sleep_s: 6, first_only_dir: /tmp/marks}
"""

from __future__ import annotations

import os
import time
import zlib
from pathlib import Path

from verl_async.envs import EnvRow, RetryEnv, Step


class SlowEnv(RetryEnv):
    """``RetryEnv`` whose ``step`` first sleeps ``sleep_s`` (with ``first_only_dir``: only in
    the first episode of each prompt)."""

    def __init__(self, sleep_s: float, first_only_dir: str = "", **retry_args) -> None:
        super().__init__(**retry_args)
        self.sleep_s = float(sleep_s)
        self.first_only_dir = first_only_dir
        self.slow = True

    def reset(self, row: EnvRow) -> None:
        """As ``RetryEnv``; also decides whether this episode is the slow one."""
        super().reset(row)
        if self.first_only_dir:
            mark = Path(self.first_only_dir) / f"{zlib.crc32(str(row.prompt).encode())}"
            try:
                os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                self.slow = False

    def step(self, text: str) -> Step:
        """``RetryEnv.step``, after the sleep."""
        if self.slow:
            time.sleep(self.sleep_s)
        return super().step(text)
