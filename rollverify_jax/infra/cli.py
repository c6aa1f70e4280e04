"""Entry-point plumbing shared by the command-line tools: bad input becomes one message and exit status 2."""

from __future__ import annotations

import logging
import os
import sys
import tokenize
import traceback
from collections.abc import Callable

# What a user's input can raise: a bad gin binding or value (ValueError; a value of the wrong type is one too,
# said by RunSpec.from_gin), a missing file, a gin syntax error (SyntaxError, or TokenError for an unclosed bracket).
USER_ERRORS = (ValueError, FileNotFoundError, SyntaxError, tokenize.TokenError)


def is_user_error(e: BaseException) -> bool:
    return isinstance(e, USER_ERRORS)


def _message(e: BaseException) -> str:
    if isinstance(e, tokenize.TokenError):  # its str() is a tuple: ('EOF in multi-line statement', (2, 0))
        return f"gin binding is not closed ({e.args[0]}): check its brackets and quotes."
    return str(e)


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
    except Exception as e:
        if not is_user_error(e):
            raise
        if show_traceback:
            traceback.print_exc()
        print(f"error: {_message(e)}", file=sys.stderr)
        if not show_traceback:
            print("(run again with --traceback for the full stack)", file=sys.stderr)
        raise SystemExit(2) from None


def run_and_exit(main: Callable[[], None]) -> None:
    """A command's ``__main__``: runs ``main``, then ends the process at once with its exit status.

    By the time ``main`` returns (or raises ``SystemExit``) a training run has closed everything it opened: its
    last checkpoint committed, its grader and tool pools stopped, the metrics written, the lock released, the
    summary printed. What the interpreter's own exit would do after that is only teardown: joining threads, the
    exit hooks (JAX's clears its backends), freeing the module state with every array and compiled program. After
    the summary of a 2-step tiny run at load 13-14 that took 6-15 s (the hooks 2-6 s, the freeing 4-9 s), time in
    which a caller's limit killed runs that had finished. So the streams and logs are flushed, JAX's distributed
    service (when this process joined one) is left (the other processes wait at its barrier), and ``os._exit``
    ends the process. An exception other than ``SystemExit`` takes the interpreter's usual way out, with its
    traceback."""
    try:
        main()
        status = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    logging.shutdown()
    jax = sys.modules.get("jax")
    if jax is not None:
        try:
            jax.distributed.shutdown()  # does nothing unless this process joined others
        except Exception as e:  # the run's outcome is decided: said, not changed
            print(f"warning: leaving JAX's distributed service failed: {e}", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(status)


def add_process_flags(ap) -> None:
    """The multi-process flags every entry point takes (train, evaluate, export)."""
    ap.add_argument("--distributed", action="store_true",
                    help="multi-host: join the other processes (every host runs the same command); without the "
                         "three flags below JAX detects the cluster (TPU pod slice, SLURM)")
    ap.add_argument("--coordinator_address", default=None, help="host:port of process 0 (implies --distributed)")
    ap.add_argument("--num_processes", type=int, default=None, help="processes in the run (implies --distributed)")
    ap.add_argument("--process_id", type=int, default=None, help="this process's index (implies --distributed)")


_CLUSTER_FLAGS = ("coordinator_address", "num_processes", "process_id")


def start_process(spec, args) -> None:
    """What every entry point does first, once its ``RunSpec`` is read and before anything compiles or touches a
    device: JAX's persistent compilation cache (``compilation_cache.*``), then joining the other processes when
    the flags of ``add_process_flags`` ask for it (``initialize.*`` timeouts)."""
    from rollverify_jax.infra import compile_cache, distributed

    compile_cache.compilation_cache(**spec.compile_cache)
    distributed.initialize_from_flags(args, {k: v for k, v in spec.distributed.items() if k not in _CLUSTER_FLAGS})
