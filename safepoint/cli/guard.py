"""The one place where the CLI turns an exception into an exit code and one line on stderr.

Exit 1 is a verdict on a checkpoint, and commands return it themselves. Everything that escapes a
command is therefore *not* a verdict: a Prefect server that did not start, a database or network
failure, a bug. Reporting any of those as 1 would make a script treat a good checkpoint as bad, so
each exits 2 with `safepoint: error: ...` (one line, secrets redacted) and the traceback only
under `-v`.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import TextIO

from safepoint.core.errors import SafepointError

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130  # the shell's convention for SIGINT
EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE: what `safepoint ls | head` reports for any Unix tool
MAX_LINE = 400


def one_line(exc: BaseException) -> str:
    """`safepoint: error: ...` for `exc`: first meaningful line, redacted, bounded.

    Safepoint's own errors are phrased for the user and printed as they are; anything else is
    prefixed with its type, because `ConnectionRefusedError: [Errno 111]` says more than the bare text.
    """
    from safepoint.core.redact import redact  # its patterns compile in ~1 ms: paid only on an error

    text = redact(str(exc)) or ""
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if not isinstance(exc, SafepointError):
        first = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    if len(first) > MAX_LINE:
        first = first[: MAX_LINE - 3] + "..."
    return f"safepoint: error: {first}"


def exit_code(exc: BaseException) -> int:
    """Every exception that reaches the entry point is an infrastructure or usage failure."""
    return EXIT_INTERRUPTED if isinstance(exc, KeyboardInterrupt) else EXIT_ERROR


def guarded(command: Callable[[], int], *, verbose: bool, stderr: TextIO) -> int:
    """Run `command`; map anything it raises to (exit code, one line), traceback under `verbose`."""
    try:
        return command()
    except SystemExit as e:  # argparse and friends: keep their code, but never a bare 1
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_ERROR)
        return EXIT_ERROR if code == 1 else code
    except BaseException as e:  # noqa: BLE001 - this is the boundary; everything is reported once
        if isinstance(e, BrokenPipeError) and stdout_closed():
            # The reader went away (`safepoint ls | head`): no error line, and none at exit either.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_PIPE_CLOSED
        if verbose:
            traceback.print_exc(file=stderr)
        print(one_line(e) if not isinstance(e, KeyboardInterrupt) else "safepoint: interrupted", file=stderr)
        stderr.flush()
        return exit_code(e)


def stdout_closed() -> bool:
    """True when stdout is a pipe whose reader has gone (POLLERR), not a socket that broke."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLERR)
        return any(ev & select.POLLERR for _fd, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no real stdout (captured): not ours to judge
        return False


def exit_now(code: int) -> None:
    """End a finished command's process without the interpreter's teardown; return where one is needed.

    Freeing what a command loaded costs more than many commands' own work: after one botocore S3
    client, the interpreter's teardown takes 0.15 s of CPU (measured: a restore's whole tail), while
    a process that has nothing left to do needs only its exit handlers and its output flushed. So:
    exit handlers (logging's flush among them), stdout and stderr flushed, then `os._exit(code)`.
    Not in a process that loaded Prefect (its services stop in their own order) or that still runs a
    non-daemon thread (the interpreter would wait for it): those return and exit the usual way.
    Files are never left half-written: every write of Safepoint's is closed (and fsynced) where it
    is made, and the catalog commits each transaction.
    """
    if "prefect" in sys.modules or any(t.is_alive() and not t.daemon and t is not threading.main_thread()
                                       for t in threading.enumerate()):
        return
    atexit._run_exitfuncs()  # what the interpreter runs first at exit: every registered handler
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:  # the reader went away (`safepoint ls | head`): as guarded() reports it
            code = EXIT_PIPE_CLOSED if stream is sys.stdout else code
        except (OSError, ValueError):  # closed or gone: nothing more can be said there
            pass
    os._exit(code)
