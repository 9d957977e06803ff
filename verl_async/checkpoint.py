"""Checkpoint directories and their manifests: the commit point of a checkpoint.

Layout (part of the run directory, docs/run_dir.md)::

    <run_dir>/checkpoints/step_NNNNNNNN/
        ...                  files written by the learner and the buffer, in any order
        manifest.json        written last: step, version, every file with size and sha256

A checkpoint exists only once its ``manifest.json`` does. The manifest is written to a
temporary name, flushed to disk and renamed into place (``os.replace`` is atomic on POSIX),
so a crash leaves either no manifest or a complete one. ``verify`` re-hashes every file:
a truncated or altered file, or one the manifest does not list, is reported, and
``newest_valid`` then falls back to the next older checkpoint with a log line saying why.

Reading. A checkpoint is untrusted until its manifest verifies: every reader calls
``require_valid`` on the part it reads before it opens any of its files (DCP's
``.metadata`` is a pickle, and unpickling runs code), and a checkpoint a peer names
(``endpoints.resume_from``) must be a step directory of the run's own ``checkpoints/``
(``in_run``). A file the manifest does not list fails verification rather than being
ignored: readers find some files by listing a directory (DCP reads what its
``.metadata`` names, ``join_optimizer`` takes every tensor of a file), and the writer
never leaves such a file behind, so one is either damage or somebody else's.

``reading`` holds a run's checkpoints still while a process outside the run reads one
(``verl-async export``): ``prune`` leaves every checkpoint in place while a reader holds
it, and prunes at the next commit instead. A checkpoint that fails verification when a
run resumes is renamed ``damaged_step_N`` and kept for a look; ``prune`` deletes it once
it is older than every checkpoint kept.

``<run_dir>/checkpoints/spare/`` (when the learner prunes) is a retired checkpoint kept for
its files: its manifest is deleted first, so it is never a checkpoint, and the next write
renames it into place and overwrites its files where they lie. Overwriting allocated files
costs the file system less than creating and deleting a set of files per checkpoint
(BENCHMARKS.md section 6).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

log = logging.getLogger("verl_async.checkpoint")

MANIFEST = "manifest.json"
SPARE = "spare"
SHARDS = "learner/shards"  # the DCP files of a learner of several ranks (learners/checkpoints/)
_PREFIX = "step_"
_STEP_NAME = re.compile(r"step_(\d+)")  # what ``step_dir`` makes; nothing else is a checkpoint
DAMAGED = "damaged_"  # a committed checkpoint that failed verification at a resume


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


def verify(ckpt: Path, part: str = "") -> list[str]:
    """Problems with ``ckpt`` (empty when every listed file has its size and sha256 and
    no other file is there). ``part``: only the files under that subdirectory (a reader
    checks what it reads: ``learner``, ``buffer``)."""
    try:
        manifest = read_manifest(ckpt)
    except CheckpointError as exc:
        return [str(exc)]
    prefix = f"{part}/" if part else ""
    listed = {rel: entry for rel, entry in manifest.files.items() if rel.startswith(prefix)}
    problems = []
    for rel, entry in listed.items():
        path = ckpt / rel
        if not _inside(ckpt, path):
            problems.append(f"{rel}: outside the checkpoint directory")
        elif path.is_symlink() or not path.is_file():
            problems.append(f"{rel}: missing")
        elif path.stat().st_size != entry.bytes:
            problems.append(f"{rel}: {path.stat().st_size} bytes, manifest says {entry.bytes}")
        elif sha256_file(path) != entry.sha256:
            problems.append(f"{rel}: sha256 differs from the manifest (file altered)")
    root = ckpt / part if part else ckpt
    for path in sorted(root.rglob("*")) if root.is_dir() else []:
        rel = str(path.relative_to(ckpt))
        if rel not in listed and rel != MANIFEST and not path.is_dir():
            problems.append(f"{rel}: not in the manifest (the writer never wrote it)")
    return problems


def _inside(ckpt: Path, path: Path) -> bool:
    """Whether ``path`` (a manifest entry joined to ``ckpt``) stays inside ``ckpt``: an
    altered manifest must not make ``verify`` hash, or a reader open, files elsewhere."""
    return path.resolve().is_relative_to(ckpt.resolve())


def require_valid(ckpt: Path, part: str = "") -> Manifest:
    """The manifest of ``ckpt`` once ``part`` of it verifies (``verify``); a
    ``CheckpointError`` naming the problems otherwise. Every reader calls this before it
    opens a file of the checkpoint."""
    problems = verify(ckpt, part)
    if problems:
        what = f"{ckpt.name}/{part}" if part else ckpt.name
        raise CheckpointError(f"{what} fails verification: {'; '.join(problems[:5])}")
    return read_manifest(ckpt)


def in_run(run_dir: str | Path, ckpt: str | Path) -> Path:
    """``ckpt`` (a path a peer or a file named) as a step directory directly inside the
    run's ``checkpoints/``, symlinks resolved; a ``CheckpointError`` for anything else."""
    path, root = Path(ckpt).resolve(), checkpoints_root(run_dir).resolve()
    if path.parent != root or step_of(path.name) is None:
        raise CheckpointError(
            f"'{ckpt}' is not a checkpoint of the run in '{Path(run_dir)}' (a checkpoint "
            f"is a step_NNNNNNNN directory in {root})"
        )
    return path


def step_of(name: str) -> int | None:
    """The step of a checkpoint directory's name (None: not a checkpoint's name)."""
    match = _STEP_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint directories, oldest first (committed or not). Only names ``step_dir``
    makes count: a ``step_00000003.bak`` left by hand is not a checkpoint."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and step_of(p.name) is not None]
    return sorted(dirs, key=lambda p: step_of(p.name))


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
    """Delete all but the newest ``keep_last`` committed checkpoints, uncommitted
    directories older than the newest committed one (abandoned writes) and damaged ones
    older than every checkpoint kept. Returns what went; nothing while a reader holds the
    checkpoints (``reading``): the next prune does it.

    ``recycle``: the first committed checkpoint to go becomes the spare (``retire``) instead
    of being deleted, unless there is one already."""
    with _pruning(run_dir) as allowed:
        if not allowed:
            log.info("a reader holds the checkpoints (verl-async export?); pruning later")
            return []
        return _prune(run_dir, keep_last, recycle)


def _prune(run_dir: str | Path, keep_last: int, recycle: bool) -> list[Path]:
    dirs = list_checkpoints(run_dir)
    committed = [d for d in dirs if (d / MANIFEST).is_file()]
    keep = committed[-keep_last:] if keep_last > 0 else committed
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
    oldest_kept = step_of(keep[0].name) if keep else None
    for d in damaged(run_dir):
        if oldest_kept is not None and step_of(d.name.removeprefix(DAMAGED)) < oldest_kept:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def damaged(run_dir: str | Path) -> list[Path]:
    """The ``damaged_step_N`` directories of a run (set aside by a resume), oldest first."""
    root = checkpoints_root(run_dir)
    found = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    dirs = [p for p in found if step_of(p.name.removeprefix(DAMAGED)) is not None]
    dirs = [p for p in dirs if p.name.startswith(DAMAGED)]
    return sorted(dirs, key=lambda p: step_of(p.name.removeprefix(DAMAGED)))


def set_aside(ckpt: Path) -> Path:
    """Rename a committed checkpoint that failed verification to ``damaged_step_N`` (one
    set aside earlier at the same step is replaced)."""
    target = ckpt.with_name(DAMAGED + ckpt.name)
    if target.exists():
        shutil.rmtree(target)
    ckpt.rename(target)
    return target


@contextlib.contextmanager
def reading(run_dir: str | Path) -> Iterator[None]:
    """Hold the run's checkpoints still while a process outside the run reads one: a
    shared lock on ``checkpoints/`` that ``prune`` does not wait for (it skips)."""
    fd = os.open(checkpoints_root(run_dir), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _pruning(run_dir: str | Path) -> Iterator[bool]:
    """The writer's side of ``reading``: True when no reader holds the checkpoints."""
    fd = os.open(checkpoints_root(run_dir), os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
        else:
            yield True
    finally:
        os.close(fd)


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
