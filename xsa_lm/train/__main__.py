"""`python -m xsa_lm.train [overrides]`, the same as `xsa-lm train [overrides]`."""

import sys

from xsa_lm.config.command_line import check_overrides
from xsa_lm.train.run import main

if __name__ == "__main__":
    check_overrides("train", sys.argv[1:])
    main()
