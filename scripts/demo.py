"""`make demo`: train SA and XSA on the bundled Shakespeare corpus (experiment=demo) and compare them.

Each run is its own `xsa-lm train` process with its own run directory under outputs/demo/<time>/.
Extra arguments are passed to both runs as Hydra overrides, e.g. `python scripts/demo.py trainer.max_steps=100`.
"""

import json
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    overrides = sys.argv[1:]
    root = Path("outputs/demo") / time.strftime("%Y-%m-%d_%H-%M-%S")
    summaries = {}
    for attention in ("sa", "xsa"):
        run_dir = root / attention
        cmd = [sys.executable, "-m", "xsa_lm.cli", "train", "experiment=demo", f"attention={attention}",
               *overrides, f"hydra.run.dir={run_dir}"]  # fmt: skip
        print(f"\n$ xsa-lm {' '.join(cmd[3:])}", flush=True)
        if subprocess.run(cmd).returncode != 0:
            sys.exit(f"demo: the {attention} run failed; see {run_dir}")
        summaries[attention] = json.loads((run_dir / "summary.json").read_text())

    sa, xsa = summaries["sa"], summaries["xsa"]
    print(f"\nDemo: tiny GPT on Shakespeare, {sa['steps']} steps, {sa['tokens_seen']:,} tokens, lr {sa['lr']:g}, "
          f"seed {sa['seed']}")  # fmt: skip
    print(f"{'attention':<10}{'val loss':>10}{'val ppl':>10}{'tokens/s':>11}{'wall s':>9}")
    for name, s in summaries.items():
        print(f"{name:<10}{s['final_val_loss']:>10.4f}{s['final_val_ppl']:>10.2f}{s['tokens_per_s']:>11,.0f}"
              f"{s['wall_time_s']:>9.1f}")  # fmt: skip
    print(f"XSA - SA: {xsa['final_val_loss'] - sa['final_val_loss']:+.4f} (one seed each: not a significance test)")
    print(f"Run directories: {root}/sa, {root}/xsa (W&B offline runs inside; `wandb sync` uploads them)")


if __name__ == "__main__":
    main()
