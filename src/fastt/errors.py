"""The one error family fastt raises for problems a user can fix."""


class FasttError(Exception):
    """A user-facing error: its message says what went wrong and what to do next."""
