"""The one error family fastt raises for problems a user can fix, and its warning."""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator


class FasttError(Exception):
    """A user-facing error: its message says what went wrong and what to do next."""


class FasttWarning(UserWarning):
    """Something fastt did otherwise than the user's code asked, training the same (the `fastt` command
    prints each as one line)."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached fastt while it waited for its child processes, which it stopped; the command
    exits 128 + `signum`, as a shell reports a process ended by that signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def one_line_warnings(show: bool = True) -> Iterator[None]:
    """Inside, a `FasttWarning` is one line on stderr, each message once (`show=False`: none, as on every
    rank of a job but the first); other warnings show as Python shows them."""
    with warnings.catch_warnings():
        python, shown = warnings.showwarning, set()

        def showwarning(message: object, category: type, *rest: object) -> None:
            if not issubclass(category, FasttWarning):
                python(message, category, *rest)
            elif show and str(message) not in shown:
                shown.add(str(message))
                print(f"fastt: warning: {message}", file=sys.stderr)
        warnings.showwarning = showwarning
        yield
