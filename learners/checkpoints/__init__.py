"""The learner's checkpoints: snapshot at the barrier, write behind, verify before reading.

    manager.py  ``Checkpoints``: the one save path and the one load path, with the checks
                (nothing non-finite is written or resumed from; nothing is read before
                its manifest verifies) and the buffer's cut at the same barrier
    state.py    ``LearnerState``: what a checkpoint holds of the learner, named once
    full.py     one rank's layout: every tensor whole, in safetensors files
    shards.py   several ranks' layout: each rank's shards, written with DCP
    writer.py   rank 0's writer thread: staging slots, files, manifest, prune

At the barrier after step s-1 (s steps done, version s published) ``Checkpoints.save``
copies model, optimizer, scheduler, RNG and counters into host memory while the buffer
takes its cut as of step s (``SnapshotBuffer``: one round trip, the buffer only collects
references). Rank 0's writer thread writes the learner's files while training goes on,
then fetches the buffer's files (``FetchSnapshot``), writes them and commits the manifest
(verl_async/checkpoint.py, the on-disk format shared with the buffer, export and the CLI).

Files of ``checkpoints/step_NNNNNNNN/`` (no pickle written anywhere: tensors in
safetensors or DCP files, everything else in JSON)::

    learner/...                   the layout's files (full.py or shards.py)
    learner/trainer_state.json    step, version, counters, optimizer param groups and
                                  scalars, scheduler state, Python RNG, KL controller
                                  and critic optimizer scalars (readable)
    buffer/ledger.json            buffer/snapshot.py
    buffer/rollouts.arrow
    manifest.json                 written last: the commit
"""
