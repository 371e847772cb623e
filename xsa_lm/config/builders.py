"""Hydra's instantiate with a user's error kept as one line, and the trainer settings checked against Lightning."""

from typing import Any

from xsa_lm.compat import lightning_device_settings
from xsa_lm.config.spec import TrainerSpec
from xsa_lm.errors import UserError


def build(node: Any, **kwargs: Any) -> Any:
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


def check_trainer(trainer: TrainerSpec, strategy: object) -> str:
    """A trainer setting Lightning refuses on this machine, or a precision it would silently replace (16-mixed on
    CPU runs bf16-mixed), refused in one line naming the key; returns the precision the run trains in."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    accelerator, precision = trainer.accelerator, trainer.resolved_precision
    built = {"precision": precision, "strategy": build(strategy) if isinstance(strategy, dict) else strategy}
    given: dict[str, Any] = {}
    for key in ("accelerator", "devices", "num_nodes", "precision", "strategy"):  # Lightning refuses the last one
        given[key] = built.get(key, getattr(trainer, key))
        try:
            effective = lightning_device_settings(**given)
        except (ValueError, TypeError, RuntimeError, ImportError, MisconfigurationException) as e:
            reason, shown = " ".join(str(e).split()).rstrip("."), getattr(trainer, key)
            if isinstance(shown, dict):  # a strategy node, by its class
                shown = str(shown.get("_target_", "")).rpartition(".")[2] or shown
            raise UserError(
                f"trainer.{key}={shown}: Lightning cannot train so on this machine ({reason}); {setting_fix(key)}"
            ) from None
    if effective != precision:
        raise UserError(
            f"trainer.precision={trainer.precision}: Lightning would train in {effective} on this "
            f"trainer.accelerator={accelerator}, not {precision}: set trainer.precision={effective} or 32-true"
        )
    return precision


def setting_fix(key: str) -> str:
    if key == "accelerator":
        from lightning.pytorch.accelerators import AcceleratorRegistry

        here = sorted(name for name in AcceleratorRegistry if AcceleratorRegistry[name]["accelerator"].is_available())
        return f"this machine has trainer.accelerator={' or '.join(here)} (trainer=cpu; trainer=gpu where a GPU is)"
    return {
        "devices": "set trainer.devices to a number of devices this machine has, e.g. 1",
        "num_nodes": "set trainer.num_nodes to the number of nodes the run is launched on",
        "precision": "choose another trainer.precision, e.g. 32-true",
    }.get(key, "choose another trainer option or trainer.precision")
