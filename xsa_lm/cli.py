"""`xsa-lm <command> [hydra overrides]`: one entry point for every job."""

import importlib
import sys

COMMANDS = {
    "train": ("xsa_lm.train.run", "train one SA or XSA model (configs/train.yaml)"),
}

USAGE = "usage: xsa-lm <command> [hydra overrides | --help | --cfg job | --multirun]\n\ncommands:\n" + "\n".join(
    f"  {name:<10}{help_}" for name, (_, help_) in COMMANDS.items()
)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0 if len(sys.argv) >= 2 else 2)
    command = sys.argv[1]
    if command not in COMMANDS:
        print(f"xsa-lm: unknown command {command!r}\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    module = importlib.import_module(COMMANDS[command][0])
    # Hydra reads its overrides from sys.argv[1:]; keep the command in argv[0] for messages and relaunches.
    sys.argv = [f"{sys.argv[0]} {command}", *sys.argv[2:]]
    module.main()


if __name__ == "__main__":
    main()
