"""`xsa-lm` straight from the working tree, for a machine where it is not installed (scripts/gpu_check.sh):

    PYTHONPATH=build/gpu-bundle/site python scripts/gpu_xsa_lm.py train model=tiny ...

The installed package maps the configs/ folder to the package xsa_lm.configs (pyproject.toml's package-dir), where
Hydra finds every config; this does the same mapping, then runs the command line as `xsa-lm` would.
"""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def use_working_tree() -> None:
    """xsa_lm from REPO, with REPO/configs as xsa_lm.configs (an installed xsa-lm would be shadowed)."""
    sys.path.insert(0, str(REPO))
    configs = REPO / "configs"
    spec = importlib.util.spec_from_file_location(
        "xsa_lm.configs", configs / "__init__.py", submodule_search_locations=[str(configs)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["xsa_lm.configs"] = module
    spec.loader.exec_module(module)


if __name__ == "__main__":
    use_working_tree()
    from xsa_lm.cli import main

    main()
