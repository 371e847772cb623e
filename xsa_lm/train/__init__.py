"""One training run: LightningModule, callbacks, W&B tracking and the Hydra entry point."""
