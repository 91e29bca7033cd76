"""Errors a user can act on. The CLI prints them without a traceback."""
from __future__ import annotations


class UserError(ValueError):
    """Bad input (file, flag, shape...): the message says what is wrong and what to do."""

    user_facing = True
