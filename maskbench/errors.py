"""The two kinds of error a user can cause: maskbench prints the first line of either and exits with code 2.

Their own module at the base of the package, so every layer (and the config schema itself) can raise them.
"""


class UserError(Exception):
    """Bad input from the user (a config, a path, a missing file): `maskbench` prints its first line and
    exits with code 2. Everything else that goes wrong is a bug or a failure, and shows its traceback."""


class ConfigError(UserError, ValueError):
    """A bad configuration value or combination (a ValueError too, for callers that validate values)."""
