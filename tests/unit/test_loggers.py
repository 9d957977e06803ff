"""``trainer.loggers``: metrics.jsonl always, TensorBoard event files by default, W&B in
offline mode (no network), and the config checks of both keys."""

import json
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from verl_async.config import ConfigError, load_config
from verl_async.loggers import WANDB_RUN_ID, check_loggers, numeric
from verl_async.metrics import REQUIRED_FIELDS, MetricsWriter, read_metrics


def _row(step: int, reward: float) -> dict:
    row = dict.fromkeys(REQUIRED_FIELDS, 0.0)
    row.update(
        step=step,
        version=step + 1,
        reward_mean=reward,
        staleness_hist=[0, 64],  # a list: metrics.jsonl only
        **{"reward/correct": reward, "actor/ppo_kl": 0.01},
    )
    return row


def _write(run_dir, cfg, rows) -> MetricsWriter:
    writer = MetricsWriter(run_dir, cfg)
    for row in rows:
        writer.write(row)
    return writer


def _scalars(run_dir, tag) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)]


def test_the_default_writes_metrics_jsonl_and_tensorboard_events(tmp_path):
    cfg = load_config(None)
    assert cfg.trainer.loggers == ["tensorboard"]
    _write(tmp_path, cfg, [_row(s, 0.1 * s) for s in range(3)]).close()

    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert _scalars(tmp_path, "reward_mean") == [(0, 0.0), (1, 0.1), (2, 0.2)]
    assert _scalars(tmp_path, "reward/correct")[-1] == (2, 0.2)
    tags = EventAccumulator(str(tmp_path / "tensorboard")).Reload().Tags()["scalars"]
    assert "staleness_hist" not in tags and "step" not in tags


def test_a_resumed_run_replaces_the_tensorboard_steps_it_trains_again(tmp_path):
    cfg = load_config(None)
    _write(tmp_path, cfg, [_row(s, 0.1) for s in range(4)]).close()
    # As the launcher does on resume from a checkpoint at step 2: cut metrics.jsonl back.
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "metrics.jsonl").write_text("".join(lines[:2]))
    _write(tmp_path, cfg, [_row(s, 0.9) for s in range(2, 4)]).close()

    assert _scalars(tmp_path, "reward_mean") == [(0, 0.1), (1, 0.1), (2, 0.9), (3, 0.9)]


def test_no_loggers_writes_only_metrics_jsonl(tmp_path):
    cfg = load_config(None, ["trainer.loggers=[]"])
    _write(tmp_path, cfg, [_row(0, 0.5)]).close()
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 1
    assert not (tmp_path / "tensorboard").exists()


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    """W&B without network and without touching the home directory."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / var.lower()))
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def test_wandb_offline_logs_into_the_run_dir_and_a_resume_reuses_the_run(tmp_path, wandb_offline):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = load_config(None, ["name=tiny-wb", "trainer.loggers=[wandb]", "trainer.project=p1"])
    writer = _write(run_dir, cfg, [_row(s, 0.25 * s) for s in range(3)])
    run = writer.loggers[0].run
    assert (run.name, run.project) == ("tiny-wb", "p1")
    assert run.summary["reward_mean"] == 0.5 and run.summary["step"] == 2
    assert run.config["trainer"]["loggers"] == ["wandb"]
    writer.close()

    run_id = (run_dir / WANDB_RUN_ID).read_text()
    first = list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(first) == 1 and (first[0] / f"run-{run_id}.wandb").stat().st_size > 0
    assert not (run_dir / "tensorboard").exists()

    # The same run directory again (a resume): the same W&B run id, in a second offline
    # directory (named by the second it started in; W&B adds "-1" when that is taken).
    again = _write(run_dir, cfg, [_row(3, 1.0)])
    assert again.loggers[0].run.id == run_id
    again.close()
    assert (run_dir / WANDB_RUN_ID).read_text() == run_id
    offline = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(f"-{run_id}" in name for name in offline)
    assert len(read_metrics(run_dir / "metrics.jsonl")) == 4


def test_wandb_listed_but_not_installed_is_one_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what find_spec sees without wandb
    with pytest.raises(ConfigError) as err:
        check_loggers(["tensorboard", "wandb"])
    message = str(err.value)
    assert message.startswith("bad value for 'trainer.loggers'")
    assert "pip install 'verl-async[wandb]'" in message and "\n" not in message
    with pytest.raises(ConfigError, match="trainer.loggers"):
        load_config(None, ["trainer.loggers=[wandb]"])
    check_loggers(["tensorboard"])  # the others still pass


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.loggers=[mlflow]", "must be one of 'tensorboard', 'wandb'"),
        ("trainer.loggers=[tensorboard, tensorboard]", "'tensorboard' is listed twice"),
        ("trainer.project=[a]", "'trainer.project'"),
    ],
)
def test_bad_logger_config_names_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_only_finite_numbers_are_logged():
    row = {"step": 3, "a": 1, "b": 0.5, "c": [1, 2], "d": True, "e": float("nan"), "f": "x"}
    assert numeric(row) == {"a": 1.0, "b": 0.5}
    assert json.dumps(numeric(_row(0, 0.5)))  # every value of a real row is plain JSON
