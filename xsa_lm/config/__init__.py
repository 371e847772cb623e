"""A run's configuration: the typed schema, value checks, resume rules, the command line, and what a run derives
from its config."""
