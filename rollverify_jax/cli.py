"""Entry-point plumbing shared by the command-line tools: bad input becomes one message and exit status 2."""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Callable

# What a user's input can raise: a bad gin binding or value (ValueError), a missing file, a gin syntax error.
USER_ERRORS = (ValueError, FileNotFoundError, SyntaxError)


def _drop_orbax_tracebacks(record: logging.LogRecord) -> bool:
    """orbax logs a failed background save with its traceback before raising it where the run waits for the
    save; the CLI reports that error in one line, so the log's copy is dropped (``--traceback`` keeps it)."""
    return not (record.levelno >= logging.ERROR and "orbax" in record.pathname and record.exc_info)


def run_cli(body: Callable[[], None], show_traceback: bool) -> None:
    """Runs ``body``; a user error prints ``error: <message>`` on stderr and exits with status 2 (the full
    traceback only with ``--traceback``), so a typo in a config does not look like a crash."""
    if not show_traceback:
        logging.getLogger("absl").addFilter(_drop_orbax_tracebacks)
    try:
        body()
    except USER_ERRORS as e:
        if show_traceback:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        if not show_traceback:
            print("(run again with --traceback for the full stack)", file=sys.stderr)
        raise SystemExit(2) from None
