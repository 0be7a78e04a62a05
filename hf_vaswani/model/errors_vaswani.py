"""The exception of a user's mistake: input, settings or files that the package refuses, with a message naming what is
wrong. The `vaswani` command shows it as one line and exits with code 2; any other exception is a bug and keeps its
traceback. A ValueError, so that callers catching ValueError keep working. This file travels to the Hub with
`trust_remote_code` (the model's checks raise it): it imports nothing.
"""


class UsageError(ValueError):
    """Input, settings or files refused by the package, with a message naming the problem."""
