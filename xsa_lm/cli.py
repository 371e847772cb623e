"""`xsa-lm <command> [hydra overrides]`: one entry point for every job."""

import difflib
import importlib
import json
import os
import sys

from xsa_lm import __version__
from xsa_lm.config.command_line import ARGV_VARIABLE, run_hydra
from xsa_lm.errors import UserError, exit_on_user_error

COMMANDS = {  # command -> (module with a Hydra main, help); each reads configs/<command>.yaml
    "train": ("xsa_lm.train.run", "train one SA or XSA model"),
    "prepare": ("xsa_lm.data.run", "tokenize a corpus into shards"),
    "analyze": ("xsa_lm.analysis.run", "Figure 1 diagnostics per layer"),
    "eval": ("xsa_lm.eval.run", "zero-shot tasks through lm-evaluation-harness"),
    "generate": ("xsa_lm.eval.sample", "text from a checkpoint, with a KV cache"),
    "consolidate": ("xsa_lm.train.consolidate", "a sharded checkpoint (trainer=fsdp) as one file"),
    "export": ("xsa_lm.export.run", "a checkpoint as a Hugging Face transformers model"),
    "sweep": ("xsa_lm.sweep.run", "LR search on SA, then SA vs XSA at that LR per seed"),
    "scale": ("xsa_lm.scale.run", "the sweep at several sizes, XSA's compute multiplier"),
    "plan": ("xsa_lm.sweep.plan", "memory per device, largest micro-batch, GPU-hours of a run or study"),
    "bench": ("xsa_lm.bench.run", "SA vs XSA time and memory, Lightning vs plain, MFU"),
}

USAGE = "usage: xsa-lm --version | <command> [hydra overrides | --help | --cfg job | --multirun]\n\ncommands:\n"
USAGE += "\n".join(f"  {name:<13}{help_} (configs/{name}.yaml)" for name, (_, help_) in COMMANDS.items())


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0 if len(sys.argv) >= 2 else 2)
    if sys.argv[1] in ("-V", "--version"):  # what a bug report names
        print(f"xsa-lm {__version__}")
        sys.exit(0)
    command = sys.argv[1]  # run() hands Hydra sys.argv without it
    try:
        run(command)
    except KeyboardInterrupt:  # training's own Ctrl-C stops at a step and exits 130 itself; this is any other moment
        print(f"xsa-lm: interrupted (Ctrl-C) during xsa-lm {command}", file=sys.stderr)
        sys.exit(130)


def run(command: str) -> None:
    with exit_on_user_error():  # the job has its own (one_line_errors); this one covers what runs before it
        if command not in COMMANDS:
            close = difflib.get_close_matches(command, COMMANDS, n=1)
            guess = f": did you mean {close[0]!r}?" if close else ""
            raise UserError(
                f"unknown command {command!r}{guess} (commands: {', '.join(COMMANDS)}; xsa-lm --help describes them)"
            )
        module = importlib.import_module(COMMANDS[command][0])
    os.environ[ARGV_VARIABLE] = json.dumps(sys.argv)  # Hydra gets sys.argv without the command: full_command_line()
    run_hydra(command, module.main, sys.argv[2:])


if __name__ == "__main__":
    main()
