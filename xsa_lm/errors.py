"""Errors a user can cause. The CLI prints them as one line and exits non-zero."""


class UserError(Exception):
    """A mistake in the configuration or the inputs, with a message that says how to fix it."""


def build(node, **kwargs):
    """hydra.utils.instantiate, but a UserError raised by the target surfaces as itself (one line for the user)."""
    import hydra
    from hydra.errors import InstantiationException

    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as e:
        cause = e.__cause__
        while cause is not None and not isinstance(cause, UserError):
            cause = cause.__cause__
        if cause is not None:
            raise cause from None
        raise
