"""The error of bad data input (kept apart so every data module can raise it without an import cycle)."""

from __future__ import annotations

from ..config import ConfigError


class DataConfigError(ConfigError):
    """Bad data input (a field of `DataArgs`, a missing file, an empty split). The message names
    the field and the fix; raised before any expensive work where possible. Fields that
    launch/train.py sets from a flag are named by the flag (`--train_file`), the others as
    `DataArgs.<field>`."""
