"""`python -m xsa_lm.train [overrides]`, the same as `xsa-lm train [overrides]`."""

import sys

from xsa_lm import cli

if __name__ == "__main__":
    sys.argv = [sys.argv[0], "train", *sys.argv[1:]]
    cli.main()
