"""A run's configuration: the typed schema, its checks, the resume rules, the command line."""
