"""Checkpoint manifests: commit last, verify every byte (and nothing unlisted), fall back
past a damaged one, prune what is old, never what a reader holds."""

import json
import logging

import pytest

from verl_async.checkpoint import (
    MANIFEST,
    CheckpointError,
    commit,
    damaged,
    in_run,
    list_checkpoints,
    newest_valid,
    prune,
    read_manifest,
    reading,
    require_valid,
    set_aside,
    spare_dir,
    step_dir,
    take_spare,
    verify,
)
from verl_async.launch.run_dir import truncate_steps
from verl_async.metrics import read_metrics


def _write(run_dir, step, payload=b"weights"):
    ckpt = step_dir(run_dir, step)
    (ckpt / "learner").mkdir(parents=True)
    (ckpt / "learner" / "model.bin").write_bytes(payload * 100)
    (ckpt / "buffer.arrow").write_bytes(b"rollouts" + bytes([step]))
    return ckpt


def test_commit_lists_every_file_with_its_hash_and_verifies(tmp_path):
    ckpt = _write(tmp_path, 3)
    manifest = commit(ckpt, step=3, version=3, meta={"epoch": 0})
    assert set(manifest.files) == {"learner/model.bin", "buffer.arrow"}
    assert manifest.files["learner/model.bin"].bytes == 700
    assert read_manifest(ckpt) == manifest
    assert verify(ckpt) == []
    assert not (ckpt / (MANIFEST + ".tmp")).exists()


def test_truncated_and_altered_files_are_reported(tmp_path):
    ckpt = _write(tmp_path, 1)
    commit(ckpt, 1, 1)
    model = ckpt / "learner" / "model.bin"
    model.write_bytes(model.read_bytes()[:-1])
    assert verify(ckpt) == ["learner/model.bin: 699 bytes, manifest says 700"]
    model.write_bytes(b"W" + (b"weights" * 100)[1:])  # same size, one byte changed
    assert verify(ckpt) == ["learner/model.bin: sha256 differs from the manifest (file altered)"]
    (ckpt / "buffer.arrow").unlink()
    assert "buffer.arrow: missing" in verify(ckpt)


def test_uncommitted_directory_is_not_a_checkpoint(tmp_path):
    ckpt = _write(tmp_path, 2)
    assert verify(ckpt) == ["step_00000002: no manifest.json (the write never committed)"]
    (ckpt / MANIFEST).write_text("{not json")
    assert "unreadable" in verify(ckpt)[0]


def test_newest_valid_falls_back_with_a_log_line(tmp_path, caplog):
    for step in (1, 2, 3):
        commit(_write(tmp_path, step), step, step)
    _write(tmp_path, 4)  # a write that never committed
    bad = step_dir(tmp_path, 3) / "buffer.arrow"
    bad.write_bytes(b"damaged!!")
    with caplog.at_level(logging.WARNING, logger="verl_async.checkpoint"):
        found = newest_valid(tmp_path)
    assert found is not None and found[1].step == 2
    assert "step_00000004" in caplog.text and "never committed" in caplog.text
    assert "step_00000003" in caplog.text and "buffer.arrow" in caplog.text


def test_newest_valid_is_none_without_checkpoints(tmp_path):
    assert newest_valid(tmp_path) is None


@pytest.mark.parametrize("keep", [1, 2])
def test_prune_keeps_the_newest_and_drops_abandoned_writes(tmp_path, keep):
    _write(tmp_path, 1)  # abandoned (older than a committed one)
    for step in (2, 3, 4):
        commit(_write(tmp_path, step), step, step)
    _write(tmp_path, 5)  # in progress: newer than every committed one, kept
    prune(tmp_path, keep)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == [f"step_{s:08d}" for s in [2, 3, 4][-keep:]] + ["step_00000005"]


def test_recycling_prune_retires_one_committed_checkpoint_and_deletes_the_rest(tmp_path):
    _write(tmp_path, 1)  # abandoned: deleted, never made the spare
    for step in (2, 3, 4, 5):
        commit(_write(tmp_path, step), step, step)
    removed = prune(tmp_path, keep_last=1, recycle=True)
    assert [p.name for p in removed] == [f"step_{s:08d}" for s in (1, 2, 3, 4)]
    spare = spare_dir(tmp_path)
    assert (spare / "learner" / "model.bin").is_file()  # step 2's files, kept for reuse
    assert not (spare / MANIFEST).exists() and verify(spare) != []
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000005"]
    assert newest_valid(tmp_path)[1].step == 5
    target = step_dir(tmp_path, 6)
    assert take_spare(tmp_path, target) and (target / "learner" / "model.bin").is_file()
    assert not take_spare(tmp_path, step_dir(tmp_path, 7))  # only one spare


def test_jsonl_readers_skip_a_torn_last_line(tmp_path):
    # A reader racing the learner, or a learner killed mid-write, sees half a line.
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 0.5} for s in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')
    assert read_metrics(path) == rows
    truncate_steps(path, 3)
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in rows[:3])
    assert read_metrics(path) == rows[:3]


def test_a_file_the_manifest_does_not_list_fails_verification(tmp_path):
    """Readers find some files by listing (DCP reads what its .metadata names): a file the
    writer never wrote is damage or somebody else's, never ignored."""
    ckpt = _write(tmp_path, 1)
    commit(ckpt, 1, 1)
    (ckpt / "learner" / "extra.distcp").write_bytes(b"planted")
    assert verify(ckpt) == ["learner/extra.distcp: not in the manifest (the writer never wrote it)"]
    assert verify(ckpt, "learner") == verify(ckpt)
    assert verify(ckpt, "buffer") == []  # a reader of another part is not concerned
    with pytest.raises(CheckpointError, match="step_00000001/learner fails verification"):
        require_valid(ckpt, "learner")


def test_a_manifest_entry_outside_the_checkpoint_is_never_opened(tmp_path):
    ckpt = _write(tmp_path, 1)
    commit(ckpt, 1, 1)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["files"]["../../secret"] = {"bytes": 1, "sha256": "0" * 64}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    (tmp_path / "secret").write_bytes(b"s")
    assert verify(ckpt) == ["../../secret: outside the checkpoint directory"]


def test_only_step_directories_are_checkpoints(tmp_path):
    """A copy left by hand (step_*.bak) is neither listed nor a reason to fail."""
    commit(_write(tmp_path, 2), 2, 2)
    (tmp_path / "checkpoints" / "step_00000002.bak").mkdir()
    (tmp_path / "checkpoints" / "step_x").mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002"]
    assert newest_valid(tmp_path)[1].step == 2


def test_damaged_checkpoints_are_pruned_once_older_than_every_kept_one(tmp_path):
    for step in (1, 2):
        commit(_write(tmp_path, step), step, step)
    first = set_aside(step_dir(tmp_path, 2))
    assert first.name == "damaged_step_00000002" and damaged(tmp_path) == [first]
    commit(_write(tmp_path, 2), 2, 2)  # written again after the resume from step 1 ...
    set_aside(step_dir(tmp_path, 2))  # ... and damaged again: it replaces the first
    assert damaged(tmp_path) == [first]
    for step in (2, 3, 4):
        commit(_write(tmp_path, step), step, step)
        prune(tmp_path, keep_last=2)
    assert damaged(tmp_path) == []  # older than step 3, the oldest kept
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]


def test_prune_leaves_every_checkpoint_in_place_while_a_reader_holds_them(tmp_path):
    for step in (1, 2, 3):
        commit(_write(tmp_path, step), step, step)
    with reading(tmp_path):
        assert prune(tmp_path, keep_last=1, recycle=True) == []
        assert verify(step_dir(tmp_path, 1)) == []
    removed = prune(tmp_path, keep_last=1, recycle=True)
    assert [p.name for p in removed] == ["step_00000001", "step_00000002"]


def test_a_checkpoint_a_peer_names_must_be_a_step_directory_of_the_run(tmp_path):
    ckpt = _write(tmp_path, 3)
    commit(ckpt, 3, 3)
    assert in_run(tmp_path, str(ckpt)) == ckpt.resolve()
    outside = tmp_path / "elsewhere" / "step_00000003"
    outside.mkdir(parents=True)
    link = tmp_path / "checkpoints" / "step_00000009"
    link.symlink_to(outside)
    for path in (outside, link, tmp_path / "checkpoints" / "spare", tmp_path / "checkpoints"):
        with pytest.raises(CheckpointError, match="is not a checkpoint of the run"):
            in_run(tmp_path, path)
