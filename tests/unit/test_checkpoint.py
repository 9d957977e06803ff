"""Checkpoint manifests: commit last, verify every byte, fall back past a damaged one."""

import json
import logging

import pytest

from verl_async.checkpoint import (
    MANIFEST,
    commit,
    list_checkpoints,
    newest_valid,
    prune,
    read_manifest,
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
