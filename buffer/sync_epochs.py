"""Weight-sync epochs: the buffer numbers the generations of the weight-sync group.

The group learner rank 0 broadcasts weights over has a fixed membership (every vLLM worker
of every generator). When a generator process dies and is started again, its new workers
cannot enter the running group: a new one is built, epoch ``current + 1``, by everyone.
The buffer is the one place every role talks to, so it hands out the numbers:

- a generator whose engine is up sends ``JoinSync(generator_id)`` and joins the epoch in
  the reply. The first one for an id joins the current epoch (0 at the start of a run). A
  second one for the same id is a restarted process: the groups the old process held are
  taken back at once (the ledger issues them again) rather than after their lease runs
  out, and, once the current epoch's group is complete, a new epoch is wanted (while it
  is still being built, the new process joins it in the old one's place). A new epoch is
  built only at the learner's next publish, so the new process waits for weights
  announced over it (``PollVersion``) before it joins, however long the learner's step;
- learner rank 0 asks ``SyncStatus`` before each publish (and while it waits for a
  batch); when a new epoch is wanted it drops the old group, announces the weights with
  the new epoch (surviving generators see it in ``PollVersion`` and rejoin), builds the
  group and reports it complete (``formed``). A broadcast that failed makes it ask for a
  new epoch itself (``regroup``);
- an announcement carrying the wanted epoch makes it current.

Pure state; the buffer server calls it.
"""

from __future__ import annotations

from verl_async.protocol import ProtocolError


class SyncEpochs:
    def __init__(self) -> None:
        self.current = 0  # the epoch of the group the learner last announced weights over
        self.wanted = 0  # the epoch being formed; == current when none is
        self.joined: set[int] = set()  # generator ids that have joined since the buffer started
        self.formed = -1  # the newest epoch whose group the learner reported complete
        self.restarts = 0  # JoinSync from a generator id seen before

    def join(self, generator_id: int) -> tuple[int, bool]:
        """(epoch the generator's workers must join, whether it is a restart)."""
        restart = generator_id in self.joined
        self.joined.add(generator_id)
        if restart:
            self.restarts += 1
            if self.formed == self.current:
                self.regroup()
        return self.wanted, restart

    def status(self, formed: int, regroup: bool) -> None:
        """Learner rank 0's report: the group of epoch ``formed`` is complete (-1: no
        news); ``regroup``: it wants a new epoch."""
        if formed > self.current:
            raise ProtocolError(f"epoch {formed} reported complete before it was announced")
        self.formed = max(self.formed, formed)
        if regroup:
            self.regroup()

    def regroup(self) -> None:
        """A new epoch is wanted (one at a time: asking again while one is being formed
        changes nothing, so a learner and a restarted generator meet in the same one)."""
        if self.wanted == self.current:
            self.wanted = self.current + 1

    def check_announced(self, epoch: int) -> None:
        if epoch not in (self.current, self.wanted):
            raise ProtocolError(
                f"weights announced over weight-sync epoch {epoch}; the current epoch is "
                f"{self.current} and the one being formed {self.wanted}"
            )

    def announced(self, epoch: int) -> None:
        if epoch > self.current:
            self.current = epoch
        self.wanted = max(self.wanted, epoch)
