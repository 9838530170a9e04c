"""Command line: ``python -m rewriter inspect`` (also the ``k3-rewriter`` console script).

Bad input (unknown model, layer out of range, a TP size that does not divide the
model, a bad batch) ends with one line naming the problem and exit status 2. Output into
a pipe whose reader stops early (``| head -3``) ends quietly with exit status 141
(128 + SIGPIPE, what a shell reports for ``yes | head -3``).
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

# torch warns at import when NumPy is absent; nothing here uses NumPy, so keep the CLI's output clean
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from rewriter.commands.bench import add_bench_parser, run_bench  # noqa: E402
from rewriter.commands.bench_ops import add_bench_ops_parser, run_bench_ops  # noqa: E402
from rewriter.commands.compile import add_compile_parser, run_compile  # noqa: E402
from rewriter.commands.decode import add_decode_parser, run_decode  # noqa: E402
from rewriter.commands.fuzz import add_fuzz_parser, run_fuzz  # noqa: E402
from rewriter.commands.inspect import add_inspect_parser, run_inspect  # noqa: E402
from rewriter.commands.variant import VariantError  # noqa: E402
from rewriter.compiler.rules import RuleError  # noqa: E402
from rewriter.model.config import ConfigError  # noqa: E402
from rewriter.model.shape import ShapeError  # noqa: E402

SIGPIPE_STATUS = 141  # 128 + SIGPIPE (13): the status of a command a closed pipe stopped


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rewriter", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    add_inspect_parser(sub)
    add_compile_parser(sub)
    add_bench_parser(sub)
    add_bench_ops_parser(sub)
    add_decode_parser(sub)
    add_fuzz_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        status = {"compile": run_compile, "bench": run_bench, "bench-ops": run_bench_ops, "inspect": run_inspect,
                  "decode": run_decode, "fuzz": run_fuzz}[args.command](args)
        sys.stdout.flush()  # here, not at exit: a closed pipe is met where it is caught
        return status
    except BrokenPipeError:
        # the reader stopped early: stop quietly, and point stdout at /dev/null so that the
        # interpreter's own flush at exit does not report the broken pipe either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return SIGPIPE_STATUS
    except (ConfigError, ShapeError, RuleError, VariantError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
