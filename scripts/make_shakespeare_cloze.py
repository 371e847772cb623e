"""A local lm-evaluation-harness task from the bundled corpus, for rehearsing `xsa-lm eval` offline: the last word
of a verse line from the validation plays (never trained on), against 3 last words of other lines.

    python scripts/make_shakespeare_cloze.py --out tasks/ --items 300
    xsa-lm eval ckpts=[...] tasks=[tasks/shakespeare_cloze.yaml]
"""

import argparse
import json
import random
import re
from pathlib import Path

from xsa_lm.data.sources import ShakespeareCorpus

VAL_PLAYS = ["julius-caesar", "the-tempest"]  # the bundled corpus's default validation plays


def items(n: int, seed: int) -> list[dict]:
    corpus = ShakespeareCorpus(val_plays=VAL_PLAYS)
    lines = []
    for key, text in corpus.documents():
        if corpus.is_val(key):
            lines += [line.strip() for line in text.splitlines() if len(line.split()) >= 6]
    rng = random.Random(seed)
    rng.shuffle(lines)
    last = lambda line: re.sub(r"[^\w']+$", "", line.split()[-1])  # noqa: E731 - the word, without punctuation
    pool = sorted({last(line) for line in lines if last(line)})
    out = []
    for line in lines:
        answer = last(line)
        if not answer or len(out) == n:
            continue
        choices = [answer, *rng.sample([w for w in pool if w != answer], 3)]
        rng.shuffle(choices)
        context = line[: line.rfind(line.split()[-1])].rstrip()
        out.append({"context": context, "choices": choices, "answer": choices.index(answer)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("tasks"))
    parser.add_argument("--items", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "shakespeare_cloze.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in items(args.items, args.seed)))
    task = args.out / "shakespeare_cloze.yaml"
    task.write_text(f"""# Last word of a verse line (validation plays) vs 3 other lines' last words: chance is 25%.
task: shakespeare_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data.resolve()}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    print(f"wrote {task} and {data} ({args.items} items)")


if __name__ == "__main__":
    main()
