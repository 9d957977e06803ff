"""``python -m teacher --run-dir DIR --name TEACHER``: one distillation teacher's process."""

from __future__ import annotations

import logging
import signal

from verl_async.config import ConfigError
from verl_async.runtime import RunContext, load_context, report_exit, start_role
from verl_async.schema import TeacherConfig
from verl_async.transport.server import ServerOptions

log = logging.getLogger("verl_async.teacher")


def find_teacher(ctx: RunContext, name: str) -> tuple[TeacherConfig, str]:
    """The teacher ``name`` of the run, and its endpoint."""
    for teacher in ctx.cfg.distillation.processes:
        if teacher.name == name and name in ctx.endpoints.teachers:
            return teacher, ctx.endpoints.teachers[name]
    raise ConfigError(
        f"--name '{name}' is not a teacher process of this run (teachers: "
        f"{sorted(ctx.endpoints.teachers)})"
    )


def main() -> None:
    args = start_role("teacher", "verl-async distillation teacher process", with_name=True)
    with report_exit(log):
        serve(args.run_dir, args.name)


def serve(run_dir: str, name: str) -> None:
    """Load teacher ``name`` (its tokenizer checked against the student's) and answer
    scoring requests until SIGTERM."""
    import torch

    from teacher.scoring import load_teacher
    from teacher.server import TeacherServer
    from verl_async.teachers import check_tokenizer

    ctx = load_context(run_dir)
    teacher, endpoint = find_teacher(ctx, name)
    check_tokenizer(ctx.endpoints.model_path, teacher.path, teacher.name)
    # float32 on CPU (half precision there is slow and imprecise); the run's dtype on CUDA.
    device, dtype = (
        ("cuda", ctx.cfg.model.dtype) if torch.cuda.is_available() else ("cpu", "float32")
    )
    model = load_teacher(teacher.path, device, getattr(torch, dtype))
    log.info("loaded teacher '%s' from %s on %s (%s)", name, teacher.path, device, dtype)
    server = TeacherServer(
        model, endpoint, teacher.batch_size, device, ServerOptions.for_run(ctx.cfg, run_dir)
    )
    signal.signal(signal.SIGTERM, lambda signum, frame: setattr(server, "terminated", True))
    server.serve()


if __name__ == "__main__":
    main()
