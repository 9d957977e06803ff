"""On the way out, while a checkpoint write is under way, the learner is stopped first and
the buffer keeps serving the cut the write needs (verl_async/launch/plan.py ``stop_roles``).

Real processes stand in for the roles: the "buffer" answers on a Unix socket until it is
signalled; the "learner", on SIGTERM, fetches its cut from the buffer and only then
commits (writes the manifest) and exits, as a learner finishing a checkpoint write does.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

from verl_async.checkpoint import MANIFEST, step_dir
from verl_async.launch.local import LocalProcess
from verl_async.launch.plan import Role, stop_roles

BUFFER = """
import socket, sys
sock = socket.socket(socket.AF_UNIX)
sock.bind(sys.argv[1])
sock.listen()
print("ready", flush=True)
while True:
    conn, _ = sock.accept()
    conn.recv(16)
    conn.sendall(b"cut")
    conn.close()
"""

LEARNER = """
import pathlib, signal, socket, sys, time

def finish_checkpoint(signum, frame):
    conn = socket.socket(socket.AF_UNIX)
    try:
        conn.connect(sys.argv[1])
        conn.sendall(b"cut?")
        cut = conn.recv(16)
    except OSError as exc:
        cut = repr(exc).encode()
    pathlib.Path(sys.argv[2]).write_bytes(cut)  # the manifest: the write commits
    sys.exit(0 if cut == b"cut" else 3)

signal.signal(signal.SIGTERM, finish_checkpoint)
print("ready", flush=True)
while True:
    time.sleep(60)
"""


def _role(name: str, code: str, *args: str) -> Role:
    proc = LocalProcess(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout.readline() == "ready\n"
    return Role(name, proc, Path("/dev/null"))


def test_the_learner_stops_first_and_finishes_its_checkpoint_with_the_buffer_serving(tmp_path):
    sock, ckpt = str(tmp_path / "buffer.sock"), step_dir(tmp_path, 3)
    ckpt.mkdir(parents=True)  # the write under way: no manifest yet
    roles = [
        _role("buffer", BUFFER, sock),  # the order the launcher starts them in
        _role("learner", LEARNER, sock, str(ckpt / MANIFEST)),
        _role("generator0", "import time; print('ready', flush=True); time.sleep(600)"),
    ]
    stop_roles(roles, grace_s=30, run_dir=tmp_path, write_grace_s=60)
    assert (ckpt / MANIFEST).read_bytes() == b"cut"  # the buffer answered the last fetch
    assert roles[1].proc.returncode == 0
    assert all(r.proc.returncode is not None for r in roles)  # and everything stopped
