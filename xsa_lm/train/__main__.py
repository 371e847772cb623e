"""`python -m xsa_lm.train [overrides]`, the same as `xsa-lm train [overrides]`."""

from xsa_lm.train.run import main

if __name__ == "__main__":
    main()
