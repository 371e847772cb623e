"""Errors a user can cause. The CLI prints them as one line and exits non-zero."""


class UserError(Exception):
    """A mistake in the configuration or the inputs, with a message that says how to fix it."""
