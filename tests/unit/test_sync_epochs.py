"""Weight-sync epochs (buffer/sync_epochs.py): who joins which generation of the group."""

import pytest

from buffer.sync_epochs import SyncEpochs
from verl_async.protocol import ProtocolError


def test_every_generator_joins_epoch_0_and_a_restart_during_its_formation_too():
    sync = SyncEpochs()
    assert [sync.join(g) for g in (0, 1)] == [(0, False), (0, False)]
    assert sync.join(1) == (0, True)  # epoch 0 not complete yet: take the old one's place
    sync.status(formed=0, regroup=False)
    assert (sync.current, sync.wanted, sync.restarts) == (0, 0, 1)


def test_a_restart_after_formation_wants_the_next_epoch_and_its_announcement_makes_it_current():
    sync = SyncEpochs()
    sync.join(0)
    sync.status(formed=0, regroup=False)
    assert sync.join(0) == (1, True)
    assert sync.join(0) == (1, True)  # once more before it is built: still epoch 1
    sync.status(formed=-1, regroup=True)  # the learner's broadcast failed too: same epoch
    assert sync.wanted == 1
    with pytest.raises(ProtocolError, match="epoch 2"):
        sync.check_announced(2)
    sync.check_announced(1)
    sync.announced(1)
    assert (sync.current, sync.wanted) == (1, 1)
    sync.announced(0)  # an older announcement never moves it back
    assert sync.current == 1
    with pytest.raises(ProtocolError, match="reported complete before it was announced"):
        sync.status(formed=2, regroup=False)
    sync.status(formed=1, regroup=True)
    assert sync.wanted == 2
