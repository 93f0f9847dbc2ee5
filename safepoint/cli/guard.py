"""The one place where the CLI turns an exception into an exit code and one line on stderr.

Exit 1 is a verdict on a checkpoint, and commands return it themselves. Everything that escapes a
command is therefore *not* a verdict: a Prefect server that did not start, a database or network
failure, a bug. Reporting any of those as 1 would make a script treat a good checkpoint as bad, so
each exits 2 with `safepoint: error: ...` (one line, secrets redacted) and the traceback only
under `-v`.

Output that cannot be written (stdout on a full disk, closed with `>&-`) is such a failure too: a
command whose answer was lost must not exit 0, nor 1 as if it were a verdict. `checked_output`
makes every write to stdout say so (`OutputError`), and `exit_now` checks the last flush.
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
from safepoint.core.text import visible

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130  # the shell's convention for SIGINT
EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE: what `safepoint ls | head` reports for any Unix tool
MAX_LINE = 400


class OutputError(SafepointError):
    """Stdout could not be written: the command's answer is lost (exit 2, never 0 or a verdict)."""

    def __init__(self, cause: BaseException | str) -> None:
        why = cause if isinstance(cause, str) else (getattr(cause, "strerror", None) or str(cause))
        errno = getattr(cause, "errno", None)
        super().__init__(f"could not write output: {why}" + (f" (errno {errno})" if errno else ""))


class CheckedOutput:
    """sys.stdout, whose write and flush errors are `OutputError`s (a gone reader stays a BrokenPipeError)."""

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream

    def _call(self, name: str, *args: object) -> object:
        if self._stream is None:
            raise OutputError("stdout is closed")
        try:
            return getattr(self._stream, name)(*args)
        except BrokenPipeError:  # the reader went away (`safepoint ls | head`): guarded() knows it
            raise
        except OSError as e:
            raise OutputError(e) from e

    def write(self, text: str) -> int:
        return self._call("write", text)  # type: ignore[return-value]

    def flush(self) -> None:
        if self._stream is not None:  # closed from the start: nothing written, nothing lost yet
            self._call("flush")

    def isatty(self) -> bool:
        return self._stream is not None and self._stream.isatty()

    def __getattr__(self, name: str) -> object:
        if self._stream is None:
            raise OutputError("stdout is closed")
        return getattr(self._stream, name)  # fileno, encoding, buffer, ...


def checked_output() -> None:
    """Make the process's stdout report lost output as `OutputError`.

    A closed stdout or stderr (`>&-`) gets /dev/null on its descriptor first, so no file the
    command opens lands there and is written by mistake; stdout's first write then fails.
    """
    for fd in (1, 2):
        try:
            os.fstat(fd)
        except OSError:
            _devnull_on(fd)
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the process's stderr, for its life
    if not isinstance(sys.stdout, CheckedOutput):
        sys.stdout = CheckedOutput(sys.stdout)  # type: ignore[assignment]


def _devnull_on(fd: int) -> None:
    null = os.open(os.devnull, os.O_WRONLY)
    if null != fd:
        os.dup2(null, fd)
        os.close(null)


def one_line(exc: BaseException) -> str:
    """`safepoint: error: ...` for `exc`: first meaningful line, redacted, bounded.

    Safepoint's own errors are phrased for the user and printed as they are; anything else is
    prefixed with its type, because `ConnectionRefusedError: [Errno 111]` says more than the bare text.
    """
    from safepoint.core.redact import redact  # its patterns compile in ~1 ms: paid only on an error

    text = visible(redact(str(exc)) or "", keep="\n")
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
            _drop_stdout()
            return EXIT_PIPE_CLOSED
        if isinstance(e, OutputError):
            _drop_stdout()  # what is still buffered is lost too: no second error at exit
        if verbose:
            traceback.print_exc(file=stderr)
        print(one_line(e) if not isinstance(e, KeyboardInterrupt) else "safepoint: interrupted", file=stderr)
        stderr.flush()
        return exit_code(e)


def _drop_stdout() -> None:
    """/dev/null on stdout's descriptor, stdout's buffer emptied into it, and stdout silent from now:
    what was lost has been reported, and the interpreter's own last flush must not fail again."""
    _devnull_on(1)
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - a stdout that was closed from the start: nothing buffered
        pass
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the process's stdout, for its life


def stdout_closed() -> bool:
    """True when stdout is a pipe whose reader has gone (POLLERR), not a socket that broke."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLERR)
        return any(ev & select.POLLERR for _fd, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no real stdout (captured): not ours to judge
        return False


def exit_now(code: int) -> int:
    """End a finished command's process without the interpreter's teardown; where one is needed,
    return the code to exit with (2 once its output was lost: flush_output).

    Freeing what a command loaded costs more than many commands' own work: after one botocore S3
    client, the interpreter's teardown takes 0.15 s of CPU (measured: a restore's whole tail), while
    a process that has nothing left to do needs only its exit handlers and its output flushed. So:
    exit handlers (logging's flush among them), stdout and stderr flushed, then `os._exit(code)`.
    Not in a process that loaded Prefect (its services stop in their own order) or that still runs a
    non-daemon thread (the interpreter would wait for it): those return and exit the usual way.
    Files are never left half-written: every write of Safepoint's is closed (and fsynced) where it
    is made, and the catalog commits each transaction.
    """
    code = flush_output(code)
    if "prefect" in sys.modules or any(t.is_alive() and not t.daemon and t is not threading.main_thread()
                                       for t in threading.enumerate()):
        return code
    atexit._run_exitfuncs()  # what the interpreter runs first at exit: every registered handler
    code = flush_output(code)  # what the handlers printed
    try:
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # closed or gone: nothing more can be said there
        pass
    os._exit(code)


def flush_output(code: int) -> int:
    """Flush stdout: the exit code, made 2 (one line on stderr) when the command's output was lost.

    Then /dev/null takes stdout's descriptor, so the interpreter's own last flush cannot fail again
    (it would exit 120 with a traceback-like message of its own).
    """
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
        return code
    except BrokenPipeError:  # the reader went away (`safepoint ls | head`): as guarded() reports it
        _drop_stdout()
        return EXIT_PIPE_CLOSED
    except (OutputError, OSError, ValueError) as e:
        _drop_stdout()
        print(one_line(e if isinstance(e, OutputError) else OutputError(e)), file=sys.stderr)
        return code if code not in (0, 1) else EXIT_ERROR
