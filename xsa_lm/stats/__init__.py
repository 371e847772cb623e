"""Statistics as pure functions on numbers (numpy and scipy only, no files or processes): the paired comparison of
XSA against SA over seeds (paired.py) and what a comparison may claim, stall rates included (decision.py)."""
