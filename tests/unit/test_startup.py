"""The start-up breakdown: milestones in their order, first time each, from t0."""

import json

from verl_async.launch.startup import FILE, breakdown, format_breakdown, read_marks
from verl_async.runtime import mark


def test_marks_append_and_the_breakdown_orders_them(tmp_path):
    for role, event in [
        ("learner", "first step"),
        ("generator0", "engine up"),
        ("buffer", "serving"),
        ("generator1", "engine up"),
    ]:
        mark(tmp_path, role, event)
    with open(tmp_path / FILE, "a") as f:
        f.write('{"role": "learner", "ev')  # a line still being written
    marks = read_marks(tmp_path)
    assert [m["event"] for m in marks] == ["first step", "engine up", "serving", "engine up"]
    t0 = min(m["t"] for m in marks) - 1.0
    rows = breakdown(marks, t0)
    assert [(r, e) for r, e, _ in rows] == [
        ("buffer", "serving"),
        ("generator0", "engine up"),
        ("learner", "first step"),
        ("generator1", "engine up"),  # not in ORDER: after the known ones, by time
    ]
    assert all(1.0 <= s < 5.0 for _, _, s in rows)


def test_the_first_time_a_milestone_is_reached_in_this_launch_counts():
    marks = [
        {"role": "learner", "event": "first step", "t": 40.0},  # the launch before a resume
        {"role": "learner", "event": "first step", "t": 110.0},
        {"role": "learner", "event": "first step", "t": 130.0},
        {"role": "buffer", "event": "serving", "t": 102.5},
    ]
    rows = breakdown(marks, 100.0)
    assert rows == [("buffer", "serving", 2.5), ("learner", "first step", 10.0)]
    assert format_breakdown(rows) == "start-up: buffer serving 2.5 s, learner first step 10.0 s"


def test_marking_an_unwritable_run_dir_is_harmless(tmp_path):
    mark(tmp_path / "missing", "buffer", "serving")
    assert read_marks(tmp_path / "missing") == []
    assert json.loads(json.dumps(read_marks(tmp_path))) == []


def test_cpu_marks_count_live_descendants_passed_in(tmp_path):
    import subprocess
    import sys

    from verl_async.runtime import descendants_cpu, mark_cpu

    # The child computes until it has used 0.8 s of CPU (however busy the machine; few
    # clock reads, which are system time), says so, and waits: what it used is then
    # measured while it still runs.
    spin = "import sys, time\nwhile time.process_time() < 0.8: sum(range(20000))\nprint('ready', flush=True)\nsys.stdin.read()"
    child = subprocess.Popen(
        [sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        user, _ = descendants_cpu()  # the busy child, still running (a grandchild would count too)
    finally:
        child.stdin.close()
        child.wait()
    assert user > 0.5
    mark_cpu(tmp_path, "generator0", (user, 0.25))
    (line,) = [m for m in read_marks(tmp_path) if m["event"] == "cpu"]
    assert line["children_user_s"] >= round(user, 2) and line["children_sys_s"] >= 0.25
