"""What ``verl-async`` shows and how its commands behave, without starting a run's processes:
progress output, error printing, --version, --resume without a config, checkpoint.resume on
a run without a checkpoint, export into an existing directory, the generation rate."""

import io
import json
import re
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest
from rich.console import Console

from buffer.telemetry import TokenRate
from verl_async import placement
from verl_async.checkpoint import commit, step_dir
from verl_async.config import load_config, to_yaml
from verl_async.launch import cli, local, train
from verl_async.launch.local import LocalProcess
from verl_async.launch.plan import Role, backoff_s
from verl_async.launch.progress import ProgressReport, numbers, snapshot
from verl_async.launch.run_dir import RoleFailed
from verl_async.launch.train import watch

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _row(step, step_s=1.0, samples=64, reward=0.5):
    return {
        "step": step,
        "version": step + 1,
        "wall_s": float(step + 1),
        "step_s": step_s,
        "reward_mean": reward,
        "samples": samples,
        "staleness_mean": 1.25,
        "staleness_max": 2,
        "gen_tokens_per_s": 1234.0,
        "weight_sync_s": 0.003,
        "dropped_stale": 0,
    }


def _plain_console() -> Console:
    return Console(file=io.StringIO(), force_terminal=False, width=80)


@pytest.fixture
def no_signal_handlers(monkeypatch):
    """``cli._train`` installs SIGINT/SIGTERM handlers; keep pytest's own."""
    monkeypatch.setattr(cli, "_interrupt_on_signals", lambda: None)


# ---------------------------------------------------------------- 1, 2: progress output


def test_without_a_terminal_a_plain_line_is_printed_every_log_every_steps():
    console = _plain_console()
    rows = [_row(i) for i in range(5)]
    with ProgressReport(console, total=5, log_every=2) as report:
        for n in range(6):
            report.update(rows[:n])
    lines = console.file.getvalue().splitlines()
    steps = [line.split()[1] for line in lines if line.startswith("step ")]
    assert steps == ["2/5", "4/5", "5/5"]  # every 2nd step, and the last one
    last = lines[-1]
    for field in ("reward 0.50", "lag 1.2 (max 2)", "gen 1234 tok/s", "elapsed 0:00:0", "ETA"):
        assert field in last, last
    assert "━" not in console.file.getvalue()


def test_watch_prints_progress_lines_when_output_is_not_a_terminal(tmp_path):
    rows = "".join(json.dumps(_row(i)) + "\n" for i in range(4))
    script = f"open({str(tmp_path / 'metrics.jsonl')!r}, 'w').write({rows!r})"
    proc = subprocess.Popen([sys.executable, "-c", script])
    learner = Role("learner", proc, tmp_path / "learner.log")
    cfg = load_config(None, ["trainer.total_steps=4", "trainer.log_every=2"])
    console = _plain_console()
    watch([learner], cfg, tmp_path, console)
    out = console.file.getvalue()
    assert re.search(r"^step 4/4 .*reward 0\.50.*ETA 0:00:00$", out, re.M), out


def test_eta_and_samples_per_s_come_from_the_mean_step_time():
    # The first step also waited for the engines: it is left out of the mean.
    snap = snapshot([_row(0, 30.0), _row(1, 2.0), _row(2, 4.0)], total=10, elapsed_s=36)
    assert snap.eta_s == pytest.approx(7 * 3.0)
    assert snap.samples_per_s == pytest.approx(128 / 6.0)
    assert snap.lag_mean == 1.25 and snap.lag_max == 2


def test_the_terminal_bar_keeps_elapsed_eta_and_numbers_whole_at_80_columns():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=80, color_system=None)
    report = ProgressReport(console, total=100_000, log_every=1)
    report.start -= 3723  # 1:02:03 elapsed
    with report:
        report.update([_row(i, 2.0, reward=0.123) for i in range(12_345)])
    text = ANSI.sub("", out.getvalue())
    final = text[text.rindex("training") :]
    for field in (
        "12345/100000",
        "1:02:03",
        "ETA 48:41:50",  # 87655 steps x 2 s
        "reward 0.12",
        "lag 1.2 (max 2)",
        "gen 1234 tok/s",
        "32.0 samples/s",
        "sync 3 ms",
    ):
        assert field in final, final
    assert "…" not in final
    assert all(len(line) <= 80 for line in final.splitlines())


def test_a_distillation_run_shows_the_reverse_kl_to_its_teachers():
    rows = [_row(i, 2.0) for i in range(3)]
    rows[-1] |= {"distill/a/reverse_kl": 0.5, "distill/b/reverse_kl": 0.25, "distill/a/tokens": 9}
    snap = snapshot(rows, total=10, elapsed_s=6)
    assert snap.teacher_kl == 0.375
    assert numbers(snap).endswith("sync 3 ms  teacher KL 0.38")
    assert snapshot(rows[:2], total=10, elapsed_s=4).teacher_kl is None
    assert "teacher" not in numbers(snapshot(rows[:2], total=10, elapsed_s=4))


# ---------------------------------------------------------------- 3: errors print verbatim


def test_a_role_failure_prints_verbatim_with_brackets_and_long_paths(
    monkeypatch, capsys, no_signal_handlers
):
    path = "/scratch/" + "a-very-long-directory-name/" * 4 + "logs/generator0.log"
    message = (
        f"the generator0 process exited with code 1 before the run finished; last lines of "
        f"{path}:\n[bold red]ValueError[/]: bad [x] in {path}\nTraceback [1/2]"
    )

    def fail(*args, **kwargs):
        raise RoleFailed(message)

    monkeypatch.setattr(train, "train", fail)
    assert cli._train(load_config(None), None, resume=False) == 1
    assert capsys.readouterr().err == f"verl-async: {message}\n"


# ---------------------------------------------------------------- 4: data-file errors


@pytest.mark.parametrize(
    ("name", "content", "where"),
    [
        ("bad.jsonl", '{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n', "line 2"),
        ("empty.jsonl", "\n", "is empty"),
        ("nocol.jsonl", '{"prompt": "a"}\n', "neither 'reward_model'"),
        ("gone.jsonl", None, "does not exist"),
        ("bad.parquet", "PAR1 not really", "cannot be read"),
    ],
)
def test_a_bad_data_file_stops_train_at_once_with_one_line_and_exit_2(
    tmp_path, repo_root, capsys, no_signal_handlers, name, content, where
):
    deep = tmp_path / ("data-directory-with-a-long-name/" * 3)
    deep.mkdir(parents=True)
    data = deep / name
    if content is not None:
        data.write_text(content)
    run_dir = tmp_path / "run"
    config = str(repo_root / "configs/tiny.yaml")
    argv = ["train", config, "--run-dir", str(run_dir), f"data.path={data}"]
    code = cli.main([*argv, "placement.generators=[cpu]", "placement.learners=[cpu]"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1, err  # one line, long path and all
    assert err.startswith("verl-async: config error: bad value for 'data.path'")
    assert str(data) in err and where in err
    assert not run_dir.exists()  # nothing was written


@pytest.mark.parametrize("command", ["train", "buffer"])
@pytest.mark.parametrize(
    ("config", "override", "key", "fix"),
    [
        (
            "tiny_multiturn.yaml",
            "multiturn.max_episode_tokens=7",
            "multiturn.max_episode_tokens",
            "7 minus generators.max_new_tokens (4) leaves 3 tokens for a prompt, and every "
            "prompt of data.path ({data}) is longer (the shortest has 6); raise "
            "multiturn.max_episode_tokens to at least 10",
        ),
        (
            "tiny.yaml",
            "generators.max_model_len=10",
            "generators.max_model_len",
            "10 minus generators.max_new_tokens (6) leaves 4 tokens for a prompt, and every "
            "prompt of data.path ({data}) is longer (the shortest has 6); raise "
            "generators.max_model_len to at least 12",
        ),
        (
            "tiny.yaml",
            "data.max_prompt_length=3",
            "data.max_prompt_length",
            "every prompt of data.path ({data}) is longer than its 3 tokens (the shortest "
            "has 6); raise it to at least 6",
        ),
    ],
)
def test_a_limit_no_prompt_fits_stops_the_command_before_any_role_naming_its_key(
    tmp_path, repo_root, capsys, no_signal_handlers, monkeypatch, command, config, override,
    key, fix,
):  # fmt: skip
    """Prompts of 6 tokens or more (configs/data/max_digit.jsonl) and a limit below that:
    one line naming the key that set the limit and what to set it to, exit 2, before the
    run directory is made or any role starts; ``train`` and ``buffer`` alike."""

    def no_role(*args, **kwargs):
        raise AssertionError("a role was started")

    monkeypatch.setattr(train, "run_in", no_role)
    monkeypatch.setattr("verl_async.launch.role_commands._become", no_role)
    run_dir = tmp_path / "run"
    argv = [command, str(repo_root / "configs" / config), "--run-dir", str(run_dir), override]
    code = cli.main([*argv, "placement.generators=[cpu]", "placement.learners=[cpu]"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1, err  # one line, no traceback
    assert err.startswith(f"verl-async: config error: bad value for '{key}': ")
    assert fix.format(data=repo_root / "configs/data/max_digit.jsonl") in err
    assert not run_dir.exists()  # nothing was written


# ---------------------------------------------------------------- 5: checkpoint.resume


def _stopped_run(run_dir: Path, cfg) -> None:
    """What a run killed after two steps and before its first checkpoint leaves."""
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(_row(i)) + "\n" for i in range(2)))
    (run_dir / "trained.jsonl").write_text('{"step": 0}\n')
    (run_dir / "logs" / "learner.log").write_text("step 1 done\n")
    (step_dir(run_dir, 3) / "learner").mkdir(parents=True)  # a write that never committed


def test_checkpoint_resume_starts_over_a_run_stopped_before_its_first_checkpoint(tmp_path):
    from verl_async.launch.run_dir import open_run_dir

    cfg = load_config(None, ["checkpoint.resume=true"])
    run_dir = tmp_path / "run"
    _stopped_run(run_dir, cfg)
    console = _plain_console()
    assert open_run_dir(cfg, str(run_dir), console, resume=False) == (run_dir, None)
    assert "starts over" in console.file.getvalue()
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "trained.jsonl").exists()
    assert not step_dir(run_dir, 3).exists()
    log = (run_dir / "logs" / "learner.log").read_text()
    assert log.startswith("step 1 done\n") and "starts over" in log


def test_checkpoint_resume_deletes_nothing_from_a_directory_that_holds_no_run(tmp_path):
    """A --run-dir that is somebody's own directory (no run's config.yaml) is refused
    whole: its tensorboard/ and *.jsonl are not the run's to clear."""
    from verl_async.launch.run_dir import RoleFailed, open_run_dir

    cfg = load_config(None, ["checkpoint.resume=true"])
    mine = tmp_path / "mine"
    (mine / "tensorboard").mkdir(parents=True)
    (mine / "tensorboard" / "events.out").write_text("x")
    (mine / "metrics.jsonl").write_text('{"step": 0}\n')
    (mine / "config.yaml").write_text("not: [a, run, config]\n")
    with pytest.raises(RoleFailed, match="holds metrics.jsonl, tensorboard but no run"):
        open_run_dir(cfg, str(mine), _plain_console(), resume=False)
    assert (mine / "tensorboard" / "events.out").read_text() == "x"
    assert (mine / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_checkpoint_resume_resumes_when_a_checkpoint_exists(tmp_path):
    from verl_async.launch.run_dir import open_run_dir

    cfg = load_config(None, ["checkpoint.resume=true"])
    run_dir = tmp_path / "run"
    _stopped_run(run_dir, cfg)
    (step_dir(run_dir, 1) / "learner").mkdir(parents=True)
    (step_dir(run_dir, 1) / "learner" / "model.bin").write_bytes(b"w")
    commit(step_dir(run_dir, 1), step=1, version=1)
    got = open_run_dir(cfg, str(run_dir), _plain_console(), resume=False)
    assert got == (run_dir, step_dir(run_dir, 1))
    assert [
        json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
    ] == [0]


# ---------------------------------------------------------------- 6: --resume without CONFIG


@pytest.fixture
def captured_train(monkeypatch):
    calls = []
    monkeypatch.setattr(
        cli,
        "_train",
        lambda cfg, run_dir, resume, command: calls.append((cfg, run_dir, resume)) or 0,
    )
    return calls


def test_resume_reads_the_run_dirs_config_and_applies_overrides(
    tmp_path, repo_root, captured_train
):
    cfg = placement.resolve_count(load_config(repo_root / "configs/tiny.yaml", ["learner.lr=1e-4"]))
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    assert cli.main(["train", "--resume", str(tmp_path)]) == 0
    assert captured_train[-1] == (cfg, str(tmp_path), True)
    # config.yaml states generators.count (1); new generator groups bring their own count.
    two = "placement.generators=[cpu, cpu]"
    assert cli.main(["train", "--resume", str(tmp_path), "trainer.total_steps=7", two]) == 0
    resumed = captured_train[-1][0]
    assert resumed.trainer.total_steps == 7 and resumed.learner.lr == pytest.approx(1e-4)
    assert resumed.placement.generators == ["cpu", "cpu"] and resumed.generators.count is None


def test_resume_right_after_a_kill_waits_for_the_runs_last_process_then_goes_on(
    tmp_path, repo_root, capsys, no_signal_handlers, monkeypatch
):
    """The whole run was SIGKILLed a moment ago and one of its processes, on its way out,
    still holds the run directory (here for a second): ``--resume`` waits for it, says so
    on stderr, and resumes."""
    monkeypatch.chdir(repo_root)  # the config's data paths are relative to it
    extra = ["placement.generators=[cpu]", "placement.learners=[cpu]"]
    cfg = placement.resolve_count(load_config(repo_root / "configs/tiny.yaml", extra))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    resumed = []
    monkeypatch.setattr(train, "run_in", lambda cfg, path, *rest: resumed.append(path))
    hold = "import sys, time; from verl_async.lifetime import hold_run_dir; "
    hold += "hold_run_dir(sys.argv[1]); print('holding', flush=True); time.sleep(1)"
    role = subprocess.Popen(
        [sys.executable, "-c", hold, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert role.stdout.readline() == "holding\n"
        code = cli.main(["train", "--resume", str(run_dir)])
    finally:
        role.kill()
        role.wait()
    err = capsys.readouterr().err
    assert code == 0, err
    assert resumed == [str(run_dir.resolve())]
    assert f"run directory '{run_dir.resolve()}': waiting up to 10 s" in err


def test_resume_without_config_needs_a_run_there(tmp_path, capsys, captured_train):
    assert cli.main(["train", "--resume", str(tmp_path)]) == 2
    assert "holds no run (no config.yaml)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["train"])  # no config and nothing to resume
    assert captured_train == []


def test_the_resume_hint_names_no_placeholder(tmp_path, repo_root, monkeypatch):
    cfg = load_config(None, [f"data.path={repo_root / 'configs/data/max_digit.jsonl'}"])
    run_dir = tmp_path / "run"
    _stopped_run(run_dir, cfg)
    (step_dir(run_dir, 1) / "model.bin").parent.mkdir(parents=True)
    (step_dir(run_dir, 1) / "model.bin").write_bytes(b"w")
    commit(step_dir(run_dir, 1), step=1, version=1)

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "prepare", lambda *args, **kwargs: None)
    monkeypatch.setattr(local, "start_roles", lambda cfg, run_dir: [])
    monkeypatch.setattr(train, "watch", interrupted)
    console = _plain_console()
    with pytest.raises(KeyboardInterrupt):
        train.train(cfg, str(run_dir), console, resume=True)
    assert f"resume with: verl-async train --resume {run_dir}\n" in console.file.getvalue()


def test_a_dead_learner_or_buffer_resumes_the_run_up_to_max_restarts(
    tmp_path, repo_root, monkeypatch
):
    """trainer.max_restarts: each death of the learner or the buffer resumes the run from its
    newest committed checkpoint (or starts it over without one); a generator's death that
    reaches the launcher, or one death too many, ends it."""
    data = f"data.path={repo_root / 'configs/data/max_digit.jsonl'}"
    deaths: list[str] = []
    resumed_from: list = []

    def run_roles(cfg, run_dir, console, t0):
        if deaths:
            role = deaths.pop(0)
            cause = f"the {role} process exited with code -9"
            raise RoleFailed(f"{cause} before the run finished; last lines of ...",
                             role=role, cause=cause)  # fmt: skip

    def prepare(cfg, run_dir, ckpt, data_checked=False):
        resumed_from.append(ckpt and ckpt.name)

    monkeypatch.setattr(train, "run_roles", run_roles)
    monkeypatch.setattr(train, "prepare", prepare)
    monkeypatch.setattr(train, "summarize", lambda run_dir, console: None)

    def run(name: str, roles: list[str], *overrides: str) -> str:
        cfg = load_config(None, [data, *overrides])
        deaths[:] = roles
        run_dir = tmp_path / name
        _stopped_run(run_dir, cfg)
        (step_dir(run_dir, 3) / "model.bin").write_bytes(b"w")
        commit(step_dir(run_dir, 3), step=3, version=3)
        console = _plain_console()
        resumed_from.clear()
        train.train(cfg, str(run_dir), console, resume=True)
        return console.file.getvalue()

    out = run("healed", ["learner", "buffer"])  # the default, 2
    assert resumed_from == ["step_00000003"] * 3
    assert "restart 1/2: the learner process exited with code -9" in out
    assert "restart 2/2: the buffer process exited with code -9" in out
    log = (tmp_path / "healed" / "logs" / "learner.log").read_text()
    assert "restart 2/2: the buffer process exited with code -9 ---" in log
    with pytest.raises(RoleFailed, match="the learner process"):
        run("too_many", ["learner", "learner"], "trainer.max_restarts=1")
    with pytest.raises(RoleFailed, match="the buffer process"):
        run("off", ["buffer"], "trainer.max_restarts=0")
    with pytest.raises(RoleFailed, match="the generator0 process"):
        run("generator", ["generator0"])  # restarted on its own until its limit, not the run
    assert resumed_from == ["step_00000003"]  # started once, never resumed


# ---------------------------------------------------------------- 7: generation rate


def test_the_first_generation_rate_is_averaged_since_the_start_not_over_a_burst():
    # An explicit clock: with time.monotonic()'s large values, 30 - 10 in floating point
    # sometimes lands just past the 20 s window and the oldest event left it.
    t0 = 0.0
    rate = TokenRate(window_s=20, start=t0)
    # The engines took 10 s to start; then the first 8 groups come back within 7 ms.
    for i in range(8):
        rate.add(400, now=t0 + 10 + i * 0.001)
    first = rate.rate(now=t0 + 10.01)
    assert first == pytest.approx(3200 / 10.01, rel=0.01)  # not 3200 / 0.01
    # Past the window it is the window's rate, as before.
    rate.add(3200, now=t0 + 25)
    assert rate.rate(now=t0 + 30) == pytest.approx(6400 / 20)


def test_token_rate_counts_from_an_explicit_start():
    rate = TokenRate(window_s=10, start=100.0)
    rate.add(500, now=104.0)
    assert rate.rate(now=105.0) == pytest.approx(100.0)
    assert TokenRate(start=0.0).rate(now=5.0) == 0.0  # nothing yet


def test_token_rate_begin_leaves_the_engines_start_up_out():
    rate = TokenRate(window_s=20, start=0.0)
    rate.begin(now=30.0)  # the engines took 30 s; the first prompts go out now
    rate.begin(now=31.0)  # later calls change nothing
    rate.add(500, now=32.0)
    assert rate.rate(now=32.5) == pytest.approx(500 / 2.5)


# ---------------------------------------------------------------- 8: --version


def test_version_is_the_package_metadata(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"verl-async {version('verl-async')}\n"


# ---------------------------------------------------------------- 10: export


@pytest.fixture(scope="module")
def run_with_checkpoint(tmp_path_factory) -> Path:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from verl_async.launch.tiny_model import build_tiny_model
    from verl_async.schema import TinyModelConfig

    run_dir = tmp_path_factory.mktemp("run")
    model = build_tiny_model(run_dir / "model", TinyModelConfig())
    state = AutoModelForCausalLM.from_pretrained(model).state_dict()
    ckpt = step_dir(run_dir, 2)
    (ckpt / "learner").mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, ckpt / "learner" / "model.safetensors")
    commit(ckpt, step=2, version=2, meta={"model_path": str(model)})
    return run_dir


def test_export_refuses_a_non_empty_directory_and_force_replaces_it(
    run_with_checkpoint, tmp_path, capsys
):
    out = tmp_path / "exported"
    out.mkdir()
    (out / "stale.bin").write_bytes(b"old model")
    assert cli.main(["export", str(run_with_checkpoint), str(out)]) == 1
    assert "--force" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["stale.bin"]  # untouched

    assert cli.main(["export", str(run_with_checkpoint), str(out), "--force"]) == 0
    names = {p.name for p in out.iterdir()}
    assert "stale.bin" not in names and {"config.json", "model.safetensors"} <= names
    assert [p.name for p in tmp_path.iterdir()] == ["exported"]  # no temporary left beside


def test_export_into_a_new_or_empty_directory_needs_no_force(run_with_checkpoint, tmp_path):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "new" / "model"):
        assert cli.main(["export", str(run_with_checkpoint), str(out)]) == 0
        assert (out / "config.json").is_file()


def test_export_reads_the_checkpoint_it_verified_while_the_run_writes_on(tmp_path, monkeypatch):
    """A run writing checkpoints beside an export (keep_last=1, recycling) prunes nothing
    while the export reads: the export gets the weights it verified, and the checkpoint
    goes at the first prune after it (on the code before, the writer recycled the
    directory under the export, which then failed)."""
    import threading

    import torch
    from safetensors.torch import load_file, save
    from transformers import AutoModelForCausalLM

    from learners.checkpoints.writer import Checkpointer, Snapshot
    from verl_async.checkpoint import list_checkpoints
    from verl_async.launch import export
    from verl_async.launch.tiny_model import build_tiny_model
    from verl_async.schema import TinyModelConfig

    run_dir = tmp_path / "run"
    model = build_tiny_model(run_dir / "model", TinyModelConfig())
    state = {
        k: v.contiguous()
        for k, v in AutoModelForCausalLM.from_pretrained(model).state_dict().items()
    }
    writer = Checkpointer(run_dir, keep_last=1, timeout_s=30, meta={"model_path": str(model)})

    def write(step: int) -> None:
        weights = {k: v + step for k, v in state.items()}  # each step's own weights
        writer.save(Snapshot(step, step, {"learner/model.safetensors": [save(weights)]}))
        assert writer.wait()

    write(1)
    verified, go, result = threading.Event(), threading.Event(), {}
    real = export._write_model

    def held(*args):  # the export has verified step 1; the run writes on meanwhile
        verified.set()
        assert go.wait(60)
        return real(*args)

    monkeypatch.setattr(export, "_write_model", held)

    def run_export():
        try:
            result["ckpt"] = export.export(run_dir, tmp_path / "out", step=1)[0]
        except Exception as exc:  # noqa: BLE001 (reported by the assertion below)
            result["error"] = exc

    reader = threading.Thread(target=run_export)
    reader.start()
    assert verified.wait(60)
    write(2)
    write(3)  # with step 1 pruned at step 2, this would overwrite its files
    go.set()
    reader.join(60)
    assert "error" not in result, result
    out = load_file(tmp_path / "out" / "model.safetensors")
    name = "model.embed_tokens.weight"
    assert torch.equal(out[name], state[name] + 1)
    write(4)
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_00000004"]
    writer.stop()


def test_plain_progress_prints_every_due_step_even_when_several_land_between_polls():
    import io

    from rich.console import Console

    from verl_async.launch.progress import ProgressReport

    out = io.StringIO()
    report = ProgressReport(Console(file=out, force_terminal=False, width=200), 4, log_every=2)
    report.bar = None
    row = {"reward_mean": 0.1, "staleness_mean": 0.0, "staleness_max": 0, "gen_tokens_per_s": 1.0,
           "samples": 8, "step_s": 0.1, "weight_sync_s": 0.001}  # fmt: skip
    report.update([row])
    report.update([row] * 3)  # steps 2 and 3 arrived together
    report.update([row] * 4)
    assert [line.split()[1] for line in out.getvalue().splitlines()] == ["2/4", "4/4"]


class _Exited:
    """A role process that has exited with ``code`` (what ``restarted`` sees)."""

    def __init__(self, code: int) -> None:
        self.code = code
        self.signals: list[int] = []

    def poll(self) -> int:
        return self.code

    def signal_group(self, sig: int) -> None:
        self.signals.append(sig)


def test_a_role_is_restarted_on_a_nonzero_exit_up_to_its_limit_and_never_after_exit_0(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(train, "backoff_s", lambda n: 0.0)  # the wait: the next test
    console = Console(file=io.StringIO(), width=200)
    starts = []
    role = Role(
        "generator1", _Exited(-9), tmp_path / "g.log", lambda: starts.append(1) or _Exited(-9), 0, 2
    )
    first = role.proc
    assert train.restarted(role, -9, console) and train.restarted(role, -9, console)
    assert first.signals == [9]  # what the dead one left behind is killed
    assert not train.restarted(role, -9, console)  # past generators.max_restarts
    assert (len(starts), role.restarts) == (2, 2)
    done = Role("generator0", _Exited(0), tmp_path / "g0.log", lambda: _Exited(0), 0, 3)
    assert not train.restarted(done, 0, console)  # told to stop: not a death
    fixed = Role("learner", _Exited(1), tmp_path / "l.log", None, 0, 0)
    assert not train.restarted(fixed, 1, console)
    out = console.file.getvalue()
    assert "the generator1 process exited with code -9; restarting it (2/2)" in out


def test_a_role_is_restarted_only_after_a_growing_wait(tmp_path):
    """Real processes that exit 1 at once, each stamping the time first: each restart
    starts ``backoff_s`` or more after the death before it (1 s, then 2 s)."""
    console = Console(file=io.StringIO(), width=200)
    stamps = tmp_path / "stamps"
    dies = "import sys, time; open(sys.argv[1], 'a').write(f'{time.monotonic()}\\n'); sys.exit(1)"

    def start() -> LocalProcess:
        return LocalProcess([sys.executable, "-c", dies, str(stamps)], start_new_session=True)

    role = Role("generator0", start(), tmp_path / "g.log", start, 0, 2)
    while (code := role.proc.poll()) is None or train.restarted(role, code, console):
        time.sleep(0.02)  # as watch() polls
    died = [float(line) for line in stamps.read_text().split()]
    assert len(died) == 3 and role.restarts == 2
    assert died[1] - died[0] >= backoff_s(1) == 1.0
    assert died[2] - died[1] >= backoff_s(2) == 2.0
    assert "restarting it (2/2) in 2 s" in console.file.getvalue()


class _ExitsAfter:
    """A role process that runs for ``polls`` polls, then has exited with ``code``."""

    def __init__(self, polls: int, code: int) -> None:
        self.polls, self.code = polls, code

    def poll(self) -> int | None:
        self.polls -= 1
        return None if self.polls >= 0 else self.code


def test_a_generator_told_to_stop_before_the_learner_exits_is_not_a_failure(tmp_path):
    """Generators exit 0 once the learner's Shutdown reached the buffer, which can be a
    moment before the learner's own processes have exited; any other role exiting before
    the learner, even with 0, is a failure."""
    console = Console(file=io.StringIO(), width=200)
    cfg = load_config(None, [])
    generator = Role("generator0", _Exited(0), tmp_path / "g.log")
    train.watch([generator, Role("learner", _ExitsAfter(6, 0), tmp_path / "l.log")], cfg,
                   tmp_path, console)  # fmt: skip
    buffer = Role("buffer", _Exited(0), tmp_path / "b.log")
    with pytest.raises(RoleFailed, match="the buffer process exited with code 0 before the run"):
        train.watch([buffer, Role("learner", _ExitsAfter(6, 0), tmp_path / "l.log")], cfg,
                       tmp_path, console)  # fmt: skip
