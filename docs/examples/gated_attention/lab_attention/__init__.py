"""A lab's own attention variants, outside xsa_lm: configs/attention/*.yaml name them by `_target_`."""
