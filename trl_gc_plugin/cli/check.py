"""`trl-gc-check` (also `python -m trl_gc_plugin check`): its options, checked into a `Launch` (an invalid one is one
line and exit status 2), then `configcheck.check` on every file; exit 0 all fine, 1 strict mode or the launcher
refuses one, 2 one cannot be read, has no recognised format, is read only in part, or an option is invalid."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, NoReturn

from ..core.errors import UsageError

if TYPE_CHECKING:
    from ..configcheck.check import Launch
    from ..core.modes import Mode


def trainer_kinds() -> tuple[str, ...]:
    """TRL's CLI commands, then its other trainers, then `trainer` (transformers' own)."""
    from ..configcheck.launchers.trl import CLI_TRAINERS
    from ..core.facts import GENERATING_TRAINERS, RL_TRAINERS

    others = sorted((RL_TRAINERS | GENERATING_TRAINERS) - set(CLI_TRAINERS))
    return (*CLI_TRAINERS, *others, "trainer")


CHECK_DESCRIPTION = """Check training configs before launching: read each file the way its launcher does (TRL CLI,
Axolotl, LLaMA-Factory, a plain TrainingArguments JSON, an OpenRLHF or verl command line in a shell script, expanded as
bash would without running it, or a verl YAML config), run the plugin's rules on what it says, and print the facts (and
where each came from), the decisions and the one change to make. Exit status: 0 every file fine; 1 strict mode (or the
launcher itself) refuses at least one; 2 at least one file cannot be read, has no recognised format, is read only in
part where the verdict depends on what was not read, or an option is invalid."""


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `check` / `trl-gc-check`, taken as strings: `_launch` checks them (one line per bad value)."""
    parser.add_argument(
        "configs",
        nargs="+",
        metavar="CONFIG",
        help="config files (YAML or JSON); several at once share one launcher start-up",
    )
    parser.add_argument(
        "--nproc",
        metavar="N",
        help="processes the launch starts (default: the file's num_processes or accelerate config, else 1)",
    )
    parser.add_argument(
        "--trainer",
        metavar="KIND",
        help=f"the trainer a TRL config is for, one of TRL's: {', '.join(trainer_kinds())} (TRL configs: the `trl` "
        "command, default sft)",
    )
    parser.add_argument(
        "--mode",
        default=None,
        metavar="MODE",
        help="the plugin's mode to decide for: strict (a setup known to break training is refused), fix "
        "(it is overridden), warn (logged only); default: $TRL_GC_PLUGIN_MODE as the run reads it, else strict",
    )
    parser.add_argument(
        "--format",
        default="auto",
        metavar="FORMAT",
        help="auto (default, from the keys), trl, axolotl, llamafactory, training-args, openrlhf or verl",
    )
    parser.add_argument(
        "--parser",
        default="auto",
        metavar="PARSER",
        help="auto (default: the launcher's own parser where it is installed, in a subprocess; else the plugin's model "
        "of it), launcher (only the launcher's own; a file it cannot read is an error), model (only the model: fast)",
    )
    parser.add_argument(
        "--accelerate-config",
        metavar="PATH|NAME",
        help="the accelerate config the launch uses (`accelerate launch --config_file`); TRL configs may name it "
        "in `accelerate_config:`",
    )
    parser.add_argument(
        "--timeout",
        default="120",
        metavar="SECONDS",
        help="time limit for the launchers' own parsers, all files together (default 120)",
    )
    parser.add_argument(
        "--brief",
        action="store_true",
        help="one line per finding (FILE: STATUS [rule] action: reason), `FILE: ok` for a file without one",
    )
    parser.add_argument(
        "--skip-other-files",
        action="store_true",
        help="skip, silently, files that are no training config of a known launcher (a pre-commit hook over every "
        "YAML / JSON / shell file); files that are but cannot be read stay errors",
    )
    parser.add_argument(
        "--no-script-args",
        action="store_true",
        help='read a shell script\'s own arguments ("$@") as none: the script as launched without arguments (by '
        "default they are unread, and a verdict depending on them is incomplete)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print a JSON list, one object per file (path, format, facts and their sources, decisions, exit status)",
    )
    for package in CHECK_PACKAGES:
        parser.add_argument(
            f"--{package}-version",
            dest=f"v_{package}",
            metavar="VERSION",
            help=f"check for this {package} release instead of the installed one",
        )


CHECK_PACKAGES = ("transformers", "trl", "peft", "deepspeed", "torch")


def _launch(ns: argparse.Namespace) -> tuple[Launch, Mode]:
    import os

    from packaging.version import InvalidVersion, Version

    from ..configcheck.check import Launch
    from ..configcheck.detect import FORMATS
    from ..configcheck.read.accelerate import trl_bundled

    nproc = None
    if ns.nproc is not None:
        try:
            nproc = int(ns.nproc)
        except ValueError:
            raise UsageError(f"--nproc {ns.nproc!r}: expected a whole number of processes >= 1") from None
        if nproc < 1:
            raise UsageError(f"--nproc {nproc}: expected a whole number of processes >= 1")
    if ns.trainer is not None and ns.trainer not in trainer_kinds():
        raise UsageError(f"--trainer {ns.trainer!r}: not a trainer TRL has; one of {', '.join(trainer_kinds())}")
    from ..core.settings import BY_NAME, GCSettings, parse_mode

    try:
        if ns.mode is not None:
            parse_mode(ns.mode)
    except ValueError:
        raise UsageError(f"--mode {ns.mode!r}: mode accepts {BY_NAME['mode'].accepted}") from None
    resolved = GCSettings.resolve({"mode": ns.mode}, caller="trl-gc-check --mode", say=False)  # the run's precedence
    for line in resolved.problems:
        sys.stderr.write(f"trl-gc-check: {line}; using the default.\n")
    if ns.format not in ("auto", *FORMATS):
        raise UsageError(f"--format {ns.format!r}: one of auto, {', '.join(FORMATS)}")
    if ns.parser not in ("auto", "launcher", "model"):
        raise UsageError(f"--parser {ns.parser!r}: one of auto, launcher, model")
    try:
        timeout = float(ns.timeout)
    except ValueError:
        raise UsageError(f"--timeout {ns.timeout!r}: expected a number of seconds") from None
    if not timeout > 0 or timeout != timeout or timeout == float("inf"):
        raise UsageError(f"--timeout {ns.timeout!r}: expected a positive number of seconds")
    accelerate = ns.accelerate_config
    if accelerate is not None and not os.path.isfile(accelerate):
        bundled = trl_bundled(accelerate) if accelerate and "/" not in accelerate else None
        if bundled is None:
            raise UsageError(
                f"--accelerate-config {accelerate!r}: not a file, nor a config TRL ships (zero3, fsdp2, ...)"
            )
        accelerate = bundled
    versions = [(package, getattr(ns, f"v_{package}")) for package in CHECK_PACKAGES]
    versions = [(package, value) for package, value in versions if value is not None]
    for package, value in versions:
        try:
            Version(value)
        except InvalidVersion:
            raise UsageError(f"--{package}-version {value!r}: not a version number (PEP 440), e.g. 0.19.8") from None
    launch = Launch(
        nproc=nproc,
        trainer=ns.trainer,
        versions=tuple(versions),
        format=ns.format,
        parser=ns.parser,
        accelerate_config=accelerate,
        timeout=timeout,
        no_script_args=bool(getattr(ns, "no_script_args", False)),
    )
    return launch, resolved.mode


def run_check(ns: argparse.Namespace) -> int:
    """Check every config and return the exit status; problems go to stderr, one line each, never a traceback; an
    invalid option raises `UsageError`."""
    try:
        launch, mode = _launch(ns)
        from ..configcheck.check import check_files, exit_code, render, render_brief, render_json, summary

        reports = check_files(list(ns.configs), launch, mode)
        if getattr(ns, "skip_other_files", False):
            reports = [r for r in reports if not r.other]
    except UsageError:
        raise
    except Exception as exc:  # a bug of the check: one line, never a traceback
        sys.stderr.write(f"error: internal error in trl-gc-check ({type(exc).__name__}: {exc}); please report it\n")
        return 2
    if getattr(ns, "brief", False) and not ns.json:
        lines = [line for report in reports for line in render_brief(report)]
        sys.stdout.write("".join(line + "\n" for line in lines))
        return exit_code(reports)
    for report in reports:
        if report.status == "error":
            sys.stderr.write(f"error: {report.error}\n")
    if ns.json:
        sys.stdout.write(render_json(reports) + "\n")
    else:
        shown = [render(r) for r in reports if r.status != "error"]
        if shown:
            sys.stdout.write("\n\n".join(shown) + "\n")
        if len(reports) > 1:
            sys.stdout.write(("\n" if shown else "") + summary(reports) + "\n")
    return exit_code(reports)


class _CheckParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        one_line_error(self, message)


def one_line_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    raise UsageError(f"{parser.prog}: {message} (see --help)")


def usage_error(exc: UsageError) -> int:
    """Where `trl-gc-check` (and `python -m trl_gc_plugin check`) turns a `UsageError` into its one line and exit 2."""
    sys.stderr.write(f"error: {exc}\n")
    return 2


def check_main(argv: list[str] | None = None) -> int:
    """The `trl-gc-check` console script."""
    parser = _CheckParser(prog="trl-gc-check", description=CHECK_DESCRIPTION)
    add_check_arguments(parser)
    try:
        return run_check(parser.parse_args(argv))
    except UsageError as exc:
        return usage_error(exc)
