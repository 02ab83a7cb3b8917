"""The one error family fastt raises for problems a user can fix."""


class FasttError(Exception):
    """A user-facing error: its message says what went wrong and what to do next."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached fastt while it waited for its child processes, which it stopped; the command
    exits 128 + `signum`, as a shell reports a process ended by that signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
