"""`python -m xsa_lm.train [overrides]`, the same as `xsa-lm train [overrides]`."""

import sys

from xsa_lm.config.command_line import run_hydra
from xsa_lm.train.run import main

if __name__ == "__main__":
    run_hydra("train", main, sys.argv[1:])
