"""What every console script shares: one help style, one set of log levels, quiet pipes, and waits that speak.

* :class:`HelpFormatter`: descriptions printed as written, each option's default after its help;
* :func:`add_log_level`: ``--log-level`` with the same choices in every script;
* :func:`run`: runs a script's body; ``engram-master status | head -1`` ends quietly, without a traceback;
* :func:`announce_after`: a line on stderr when a wait outlasts a second, saying what is awaited;
* :func:`raise_open_files_limit`: servers raise their soft open-files limit toward the hard one at start.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

from ._peers import raise_open_files_limit  # noqa: F401 (exported by engram_store.cli)

#: The ``--log-level`` choices of every script (given in any case).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: Exit status of a script whose reader closed the pipe: that of a process killed by SIGPIPE, as shells report.
EXIT_BROKEN_PIPE = 128 + 13
#: A wait longer than this says what it waits for.
ANNOUNCE_AFTER_S = 1.0


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Plain text: the description as written, every option's default at the end of its help.

    An option whose help already says its default (``default: ...``) keeps its wording; a flag reads
    ``(default: off)``; an option whose default is None must say in its help what happens without it.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.default is None:
            return text
        if action.default is False and action.nargs == 0:
            return f"{text} (default: off)"
        default = " ".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else action.default
        return f"{text} (default: {str(default).replace('%', '%%')})"


def parser(prog: str, description: str, **kwargs) -> argparse.ArgumentParser:
    """An ArgumentParser in the house style."""
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter, **kwargs)


def non_negative(what: str) -> Callable[[str], int]:
    """An argparse ``type`` for an integer >= 0, whose error names ``what`` (e.g. "a layer id")."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < 0:
            raise argparse.ArgumentTypeError(f"expected {what} (an integer >= 0), got {text!r}")
        return value
    return parse


def add_log_level(p: argparse.ArgumentParser, default: str = "INFO") -> None:
    p.add_argument("--log-level", default=default, type=str.upper, choices=LOG_LEVELS, metavar="LEVEL",
                   help=f"log messages of this level and above: {', '.join(LOG_LEVELS)}")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run(body: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None) -> int:
    """``body(argv)``'s exit status; a reader that closed stdout (``| head``) ends it quietly (status 141)."""
    try:
        try:
            code = body(argv)
        except SystemExit as exc:  # argparse's --help and errors
            code = exc.code
        sys.stdout.flush()
    except BrokenPipeError:
        # Nothing more can be printed: point stdout at /dev/null so the interpreter's own flush at exit is quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # SystemExit("message")
    return 1


@contextmanager
def announce_after(message: str, prog: str, delay_s: float = ANNOUNCE_AFTER_S) -> Iterator[None]:
    """Print ``prog: message`` on stderr if the block is still running after ``delay_s`` (once)."""
    timer = threading.Timer(delay_s, lambda: print(f"{prog}: {message}", file=sys.stderr, flush=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()

__all__ = ["add_log_level", "announce_after", "non_negative", "parser", "raise_open_files_limit", "run", "setup_logging"]
