"""`hetrain` command line. Each area owns its subcommands in its own `cli` module
(a `register(subparsers)` function), so this file lists them, and joins the one command
that spans two areas: `launch --plan` / `launch --auto`, the planner's whole-job plans run
by the launcher (here, above both, so that neither area imports the other)."""
from __future__ import annotations

import argparse
import importlib
import signal
import sys

from hetrain.errors import UserError

# module path -> owns these subcommands
_AREAS = (
    "hetrain.runtime.cli",   # launch, demo, netns
    "hetrain.plan.cli",      # plan
    "hetrain.sched.cli",     # schedule
    "hetrain.pipeline.cli",  # train --plan
    "hetrain.train.cli",     # report
    "hetrain.plan.shard_cli",  # shard-plan
)


class _Parser(argparse.ArgumentParser):
    """Flag mistakes in one line (argparse's default prints the whole usage first);
    sub-command parsers inherit this class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def one_line(err: BaseException) -> str:
    """A message on one line: a file with several bad fields lists them joined by '; '."""
    parts = [line.strip().removeprefix("- ").strip() for line in str(err).splitlines()]
    text = ""
    for p in filter(None, parts):
        text += p if not text else (" " if text.endswith(":") else "; ") + p
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hetrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for path in _AREAS:
        try:
            module = importlib.import_module(path)
        except ModuleNotFoundError as err:
            if err.name and path.startswith(err.name):  # area not built yet in this checkout
                continue
            raise
        module.register(sub)
    if "launch" in sub.choices:
        _add_planned_launch(sub.choices["launch"])
    return parser


# ---- launch --plan / --auto: a whole-job plan, run by the launcher ----------------------

def _add_planned_launch(p: argparse.ArgumentParser) -> None:
    """The planned-launch flags on the launcher's `launch` command; its runs go through
    `_launch` below, the others to the launcher's own command."""
    w = p.add_argument_group("planned launch (see `hetrain plan --cluster`)")
    w.add_argument("--plan", metavar="FILE", help="run a whole-job plan: its cluster, mode, codec, overlap and script "
                                                  "(a SCRIPT given here replaces the plan's)")
    w.add_argument("--auto", action="store_true",
                   help="profile a few steps, plan the job on the fitted cost model, continue with the best plan "
                        "(the script must accept --balance, as the demo and hetrain.demo.zoo do)")
    w.add_argument("--auto-steps", type=int, default=12, help="steps the --auto profiling round trains (12)")
    plain = p.get_default("func")
    p.set_defaults(func=lambda args: _launch(args, plain))


def _launch(args, plain) -> int:
    if args.plan and args.auto:
        raise UserError("give --plan FILE (run a plan) or --auto (profile, plan, continue), not both")
    if args.plan:
        from hetrain.runtime.cli import script_argv
        from hetrain.runtime.launch import launch

        return launch(_planned_config(args, script_argv(args)))
    if args.auto:
        return _auto(args)
    return plain(args)


def _planned_config(args, argv: list[str], plan_path: str | None = None):
    """The launch configuration of a whole-job plan (`hetrain plan --cluster`): its cluster,
    mode, codec and overlap; the plan's script unless one is given; the plan's path in the
    job's environment, so the run records its prediction beside what it measures."""
    import os

    from hetrain.plan.job import load_job_plan
    from hetrain.runtime.cli import launch_config
    from hetrain.runtime.env import PLAN_ENV

    path = plan_path or args.plan
    plan = load_job_plan(path)
    if args.cluster:
        raise UserError("--plan carries the cluster it was planned for; leave out --cluster (or plan again)")
    if args.mode not in (None, plan.config.mode):
        raise UserError(f"--mode {args.mode} contradicts the plan's mode {plan.config.mode}; leave out --mode")
    args.mode, args.codec, args.overlap = plan.config.mode, plan.config.codec, plan.config.overlap
    cfg = launch_config(args, argv or list(plan.script), plan.cluster_spec())
    cfg.extra_env[PLAN_ENV] = os.path.abspath(path)
    return cfg


def _auto(args) -> int:
    """Profile a few steps of the job as launched (fp32, no overlap), fit the cost model
    on them, plan, and continue with the best plan in the same run folder: a script that
    commits elastic state (the demo) resumes from the profiling round's last commit."""
    import os
    import time

    from hetrain.plan.auto import fitted_from_run
    from hetrain.plan.job import plan_job, table, to_plan
    from hetrain.runtime.cli import launch_config, script_argv
    from hetrain.runtime.env import PROFILE_STEPS_ENV
    from hetrain.runtime.launch import launch
    from hetrain.runtime.launch.preflight import check_entry_point

    argv = script_argv(args)
    if not argv:
        raise UserError("--auto needs the training script (e.g. `hetrain launch --auto -m hetrain.demo.digits`)")
    check_entry_point(argv)
    if args.auto_steps < 4:
        raise UserError(f"--auto-steps must be >= 4 (steps to fit each worker's step time), got {args.auto_steps}")
    args.run_dir = args.run_dir or os.path.join("runs", f"auto-{time.strftime('%Y%m%d-%H%M%S')}")
    args.codec, args.overlap = "fp32", False
    cfg = launch_config(args, argv)
    cfg.extra_env[PROFILE_STEPS_ENV] = str(args.auto_steps)
    print(f"hetrain: --auto: profiling {args.auto_steps} steps ({cfg.comm.mode}, fp32, no overlap)")
    rc = launch(cfg)
    if rc != 0:
        return rc
    model, jc, fitted, batch = fitted_from_run(args.run_dir, cfg.cluster)
    preds = plan_job(model, jc, batch, fitted=fitted)
    print(f"hetrain: --auto: fitted overhead {fitted.overhead_s * 1e3:.1f} ms/step; candidates:")
    print(table(preds))
    plan = to_plan(preds[0], preds, model.name, cfg.cluster, jc, None)
    plan = plan.model_copy(update={"script": [*argv, "--balance", plan.config.balance]})
    path = os.path.join(args.run_dir, "plan.json")
    plan.save(path)
    print(f"hetrain: --auto: continuing with {preds[0].candidate.label()} ({path})")
    args.cluster, args.mode = None, None
    return launch(_planned_config(args, [], path))


def main(argv: list[str] | None = None) -> int:
    from hetrain.runtime import catch_stop_requests

    catch_stop_requests()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("hetrain: interrupted", file=sys.stderr)
        return 130
    except UserError as err:  # user mistakes: a message, no traceback
        print(f"hetrain: error: {one_line(err)}", file=sys.stderr)
        return 2
    except OSError as err:
        if err.filename is None:  # not about a path the user gave
            raise
        # a path from the command line that cannot be read or written (no such folder, no permission)
        print(f"hetrain: error: cannot use {err.filename}: {err.strerror or err}", file=sys.stderr)
        return 2
    finally:
        # the work is over: a stop request now has nothing to stop, and Python's shutdown
        # would restore SIGUSR1's default action (terminate) while atexit hooks still run
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
