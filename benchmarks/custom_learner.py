"""``verl-async`` with the learner role run by another module: how benchmarks and tests
change what the learner does (a pre-filled buffer, a slowed checkpoint write) without a
switch in production code.

    python -m benchmarks.custom_learner MODULE [MODULE_ARG ...] -- VERL_ASYNC_ARG ...

runs the launcher's command line (``verl_async.launch.cli``) in this process, with the
learner role started as ``python -m MODULE MODULE_ARG ... --run-dir DIR`` (each rank of
it, under torch.distributed.run with several) instead of ``python -m learners --run-dir
DIR``. MODULE installs its changes, then runs the learner with ``run_learner(rest)``.

Run it from the repository root: the roles inherit the working directory, and MODULE is
imported from it (``benchmarks.*``, ``tests.*``).
"""

from __future__ import annotations

import sys


def command(module: str, module_args: list[str], cli_args: list[str]) -> list[str]:
    """The command line of ``verl-async CLI_ARGS`` with the learner run by ``module``."""
    return [
        sys.executable,
        "-m",
        "benchmarks.custom_learner",
        module,
        *module_args,
        "--",
        *cli_args,
    ]


def swap_learner(argv: list[str], module: str, module_args: list[str]) -> list[str]:
    """``argv`` of the learner role with ``-m learners`` replaced by ``-m MODULE ARGS``."""
    i = next(i for i in range(1, len(argv)) if argv[i - 1 : i + 1] == ["-m", "learners"])
    return [*argv[:i], module, *module_args, *argv[i + 1 :]]


def run_learner(rest: list[str]) -> None:
    """The learner role's own entry point (``python -m learners``) on the arguments that
    MODULE left (``--run-dir DIR``)."""
    from learners.__main__ import main

    sys.argv = [sys.argv[0], *rest]
    main()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--")
    module, *module_args = argv[:split]
    from verl_async.launch import cli, plan

    learner_launch = plan.learner_launch

    def custom_launch(cfg, run_dir):
        argv, env = learner_launch(cfg, run_dir)
        return swap_learner(argv, module, module_args), env

    plan.learner_launch = custom_launch  # plan_roles looks it up at each call
    return cli.main(argv[split + 1 :])


if __name__ == "__main__":
    sys.exit(main())
