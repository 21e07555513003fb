"""`hopperlm VERB ...`: one verb per job. User errors print one line and exit 2 (a traceback only with --debug).

Each module here holds a family of verbs: its `cmd_*` functions and an `add_parsers` that registers them.
Verbs whose parser sets `takes_overrides` accept extra `--section.key value` pairs for their recipe.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from hopperlm import __version__
from hopperlm.cli import data, measure, models, runs, third_party_logs
from hopperlm.cli.common import one_line_error
from hopperlm.diskspace import unwritten
from hopperlm.errors import ConfigError, HopperError
from hopperlm.parallel.watchdog import supervised

# verbs that run torch: other libraries' log lines go to a file while they run (third_party_logs.py)
TORCH_VERBS = {
    "demo",
    "train",
    "finetune",
    "bench",
    "diagnose",
    "profile",
    "generate",
    "eval",
    "import",
    "export",
    "merge",
}


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show full tracebacks")
    parser = argparse.ArgumentParser(prog="hopperlm", description=__doc__.split("\n")[0], parents=[common])
    parser.add_argument("--version", action="version", version=f"hopperlm {__version__}")
    parser.error = one_line_error("")  # `hopperlm trian`: one line with the verb meant, exit 2
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for family in (runs, data, models, measure):
        family.add_parsers(verbs, common)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args, extra = build_parser().parse_known_args(argv)
    quiet = args.verb in TORCH_VERBS and not args.debug
    redirect = third_party_logs.Redirect() if quiet else None
    try:
        with redirect or contextlib.nullcontext():
            if args.takes_overrides:
                args.func(args, extra)
            elif extra:
                raise ConfigError(
                    f"unrecognised arguments: {' '.join(extra)}; see hopperlm {args.verb} --help"
                )
            else:
                args.func(args)
    except HopperError as e:
        if args.debug:
            raise
        if not supervised():  # a rank of `hopperlm launch`: the launcher prints it (recorded below)
            print(f"error: {e}", file=sys.stderr, flush=True)
        quiet_rank_exit(e, 2)
    except Exception as e:
        # a full disk, a quota, a read-only folder under a writer that said nothing itself: one line too
        full = None if args.debug else unwritten(e)
        if full is not None:
            if not supervised():
                print(f"error: {full}", file=sys.stderr, flush=True)
            quiet_rank_exit(full, 2)
        if args.debug or not supervised():
            raise
        quiet_rank_exit(e, 1)  # the traceback goes to the launcher's failure.json
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        line = redirect.summary() if redirect is not None else None
        if line:
            print(line, file=sys.stderr, flush=True)


def quiet_rank_exit(exc: Exception, code: int) -> None:
    """Exit with `code`; a rank of `hopperlm launch` records its error for the launcher's one line first
    (unless the runtime already recorded the error that came first: parallel/runtime.py `fail`)."""
    if supervised():
        from hopperlm.parallel.runtime import Runtime

        Runtime.record_for_launcher(exc)
    sys.exit(code)
