"""Checkpoint directories and their manifests: the commit point of a checkpoint.

Layout (part of the run directory, docs/run_dir.md)::

    <run_dir>/checkpoints/step_NNNNNNNN/
        ...                  files written by the learner and the buffer, in any order
        manifest.json        written last: step, version, every file with size and sha256

A checkpoint exists only once its ``manifest.json`` does. The manifest is written to a
temporary name, flushed to disk and renamed into place (``os.replace`` is atomic on POSIX),
so a crash leaves either no manifest or a complete one. ``verify`` re-hashes every file:
a truncated or altered file is reported, and ``newest_valid`` then falls back to the next
older checkpoint with a log line saying why.

``<run_dir>/checkpoints/spare/`` (when the learner prunes) is a retired checkpoint kept for
its files: its manifest is deleted first, so it is never a checkpoint, and the next write
renames it into place and overwrites its files where they lie. Overwriting allocated files
costs the file system less than creating and deleting a set of files per checkpoint
(BENCHMARKS.md section 6).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import msgspec

log = logging.getLogger("verl_async.checkpoint")

MANIFEST = "manifest.json"
SPARE = "spare"
SHARDS = "learner/shards"  # the DCP files of a learner of several ranks (learners/sharded.py)
_PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, with the reason."""


class FileEntry(msgspec.Struct, frozen=True):
    bytes: int
    sha256: str


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    step: int  # learner steps completed when the snapshot was taken
    version: int  # weights version at that point
    created_unix: float
    files: dict[str, FileEntry]  # path relative to the checkpoint directory
    meta: dict[str, int | float | str] = {}


def checkpoints_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: str | Path, step: int) -> Path:
    return checkpoints_root(run_dir) / f"{_PREFIX}{step:08d}"


def spare_dir(run_dir: str | Path) -> Path:
    return checkpoints_root(run_dir) / SPARE


def is_sharded(ckpt: Path) -> bool:
    """Whether the learner of ``ckpt`` wrote shards (several ranks) or full files (one)."""
    return (ckpt / SHARDS / ".metadata").is_file()


def read_shards(ckpt: Path, wanted, group=None, no_dist: bool = True) -> dict:
    """The full tensors of the shards of ``ckpt`` whose names ``wanted(name)`` accepts,
    read whole into this process (``no_dist``: with no process group; else every rank of
    ``group`` calls it)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(ckpt / SHARDS))
    tensors = {
        name: torch.empty(meta.size, dtype=meta.properties.dtype)
        for name, meta in reader.read_metadata().state_dict_metadata.items()
        if wanted(name) and isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(tensors, storage_reader=reader, process_group=group, no_dist=no_dist)
    return tensors


def read_sharded_model(ckpt: Path) -> dict:
    """The model's full tensors by name from the shards of ``ckpt``, read in this process
    with no process group (tied names are not in the files: each tensor is there once)."""
    tensors = read_shards(ckpt, lambda name: name.startswith("model."))
    return {name.removeprefix("model."): t for name, t in tensors.items()}


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _payload_files(ckpt: Path) -> list[Path]:
    return sorted(
        p
        for p in ckpt.rglob("*")
        if p.is_file() and p.name != MANIFEST and not p.name.endswith(".tmp")
    )


def commit(ckpt: Path, step: int, version: int, meta: dict | None = None) -> Manifest:
    """fsync and hash every file under ``ckpt``, then write the manifest last, atomically.

    (The learner's writer hashes files from the bytes it writes and calls
    ``write_manifest`` itself.)
    """
    files = {}
    for path in _payload_files(ckpt):
        with open(path, "rb") as f:  # the writers closed their files; make them durable
            os.fsync(f.fileno())
        files[str(path.relative_to(ckpt))] = FileEntry(path.stat().st_size, sha256_file(path))
    return write_manifest(ckpt, step, version, meta, files)


def write_manifest(
    ckpt: Path, step: int, version: int, meta: dict | None, files: dict[str, FileEntry]
) -> Manifest:
    """The commit itself, for a writer that has hashed and fsynced every file of ``ckpt``
    (``files`` lists them all) and made sure nothing else is there."""
    manifest = Manifest(
        step=step, version=version, created_unix=time.time(), files=files, meta=meta or {}
    )
    tmp = ckpt / (MANIFEST + ".tmp")
    with open(tmp, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(manifest)))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt / MANIFEST)
    fsync_dir(ckpt)
    fsync_dir(ckpt.parent)  # the checkpoint's own directory entry
    return manifest


def read_manifest(ckpt: Path) -> Manifest:
    path = ckpt / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{ckpt.name}: no {MANIFEST} (the write never committed)")
    try:
        return msgspec.json.decode(path.read_bytes(), type=Manifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointError(f"{ckpt.name}: unreadable {MANIFEST}: {exc}") from None


def verify(ckpt: Path) -> list[str]:
    """Problems with ``ckpt`` (empty when every listed file has its size and sha256)."""
    try:
        manifest = read_manifest(ckpt)
    except CheckpointError as exc:
        return [str(exc)]
    problems = []
    for rel, entry in manifest.files.items():
        path = ckpt / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
        elif path.stat().st_size != entry.bytes:
            problems.append(f"{rel}: {path.stat().st_size} bytes, manifest says {entry.bytes}")
        elif sha256_file(path) != entry.sha256:
            problems.append(f"{rel}: sha256 differs from the manifest (file altered)")
    return problems


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint directories, oldest first (committed or not)."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)]
    return sorted(dirs, key=lambda p: int(p.name[len(_PREFIX) :]))


def newest_valid(run_dir: str | Path, report=None) -> tuple[Path, Manifest] | None:
    """The newest checkpoint that verifies; each one skipped on the way is reported with why
    (``report(message)``; default: a warning in the log)."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        problems = verify(ckpt)
        if not problems:
            return ckpt, read_manifest(ckpt)
        message = (
            f"checkpoint {ckpt.name} fails verification ({'; '.join(problems[:3])}); "
            "falling back to an older one"
        )
        (report or log.warning)(message)
    return None


def prune(run_dir: str | Path, keep_last: int, recycle: bool = False) -> list[Path]:
    """Delete all but the newest ``keep_last`` committed checkpoints, and uncommitted
    directories older than the newest committed one (abandoned writes). Returns what went.

    ``recycle``: the first committed checkpoint to go becomes the spare (``retire``) instead
    of being deleted, unless there is one already."""
    dirs = list_checkpoints(run_dir)
    committed = [d for d in dirs if (d / MANIFEST).is_file()]
    keep = set(committed[-keep_last:]) if keep_last > 0 else set(committed)
    newest = committed[-1] if committed else None
    removed = []
    for d in dirs:
        is_committed = d in committed
        abandoned = not is_committed and newest is not None and d < newest
        if (is_committed and d not in keep) or abandoned:
            if recycle and is_committed and not spare_dir(run_dir).exists():
                retire(d)
            else:
                shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def retire(ckpt: Path) -> None:
    """Turn a committed checkpoint into the spare: its manifest goes first, durably, so the
    files can never again pass for a checkpoint, whatever happens to them next."""
    (ckpt / MANIFEST).unlink()
    fsync_dir(ckpt)
    os.rename(ckpt, ckpt.parent / SPARE)


def take_spare(run_dir: str | Path, ckpt: Path) -> bool:
    """Rename the spare to ``ckpt`` (to be overwritten in place); False if there is none."""
    try:
        os.rename(spare_dir(run_dir), ckpt)
    except FileNotFoundError:
        return False
    return True
