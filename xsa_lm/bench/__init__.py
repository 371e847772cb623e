"""`xsa-lm bench`: SA vs XSA step time and memory, Lightning vs a plain loop, tokens/s and MFU."""
