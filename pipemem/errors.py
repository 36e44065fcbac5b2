"""The one error type users see.

Anything a user can get wrong (a flag, a file, a config) raises `UserError` with a message
that names the input and says how to fix it. The CLI prints that one line and exits 2;
everything else is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """Bad input from the user: printed as one line by the CLI, exit code 2."""
