"""The lm-evaluation-harness adapter, the tasks `xsa-lm eval` takes, and its report (the CLI: test_analyze_cli)."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance

from tests.golden import assert_golden
from tests.helpers import write_local_task
from xsa_lm.data.tokenizer import EOT, train_bpe
from xsa_lm.errors import UserError
from xsa_lm.eval.run import (
    EvalResult,
    Row,
    Score,
    check_baseline,
    harness_lm,
    load_tasks,
    minus_baseline,
    paired_intervals,
    render,
    resolve_tasks,
)
from xsa_lm.model import GPT, GPTConfig

TEXTS = ["the cat sat on the mat. " * 30, "a dog ran in the park and the cat ran too. " * 30]


@pytest.fixture(scope="module")
def lm():
    """What `xsa-lm eval` scores: a model as lm-eval's `hf` backend sees it, with the tokenizer it was trained with."""
    torch.manual_seed(0)
    tokenizer = train_bpe(TEXTS, vocab_size=300)
    model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=2, head_dim=16, vocab_size=320, block_size=32, attention="xsa"))
    return model.eval(), tokenizer, harness_lm(model, tokenizer, batch_size=3)


def request(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def our_logprob(model: GPT, ids: list[int], n_scored: int) -> float:
    logprobs = F.log_softmax(model(torch.tensor([ids[:-1]])).float(), -1)[0, -n_scored:]
    return logprobs.gather(-1, torch.tensor(ids[-n_scored:]).unsqueeze(-1)).sum().item()


@torch.no_grad()
def test_the_harness_gives_our_models_log_likelihoods(lm):
    """Context and continuation tokenized together (as training saw text) and split at the context's tokens, its
    trailing spaces moved to the continuation; an empty context conditions on EOT; a text longer than the context is
    scored in windows. Batching and padding change nothing."""
    model, tokenizer, harness = lm
    eot = tokenizer.token_to_id(EOT)
    pairs = [("the cat sat on the", " mat"), ("a dog ran in the ", "park"), ("", "the cat")]
    got = harness.loglikelihood([request("loglikelihood", *p) for p in pairs])
    for (context, continuation), (logprob, greedy) in zip(pairs, got, strict=True):
        stripped = context.rstrip()
        whole = tokenizer.encode(context + continuation).ids
        head = tokenizer.encode(stripped).ids
        expected = our_logprob(model, (head or [eot]) + whole[len(head) :], len(whole) - len(head))
        assert logprob == pytest.approx(expected, abs=1e-4) and isinstance(greedy, bool)
    one_by_one = harness_lm(model, tokenizer, batch_size=1)
    single = one_by_one.loglikelihood([request("loglikelihood", *p) for p in pairs])
    assert [s for s, _ in single] == pytest.approx([s for s, _ in got], abs=1e-4)
    ids = tokenizer.encode("the cat sat").ids
    rolling = harness.loglikelihood_rolling([request("loglikelihood_rolling", "the cat sat")])[0]
    assert rolling == pytest.approx(our_logprob(model, [eot, *ids], len(ids)), abs=1e-4)
    long = TEXTS[1][:400]  # longer than the context: several windows
    total = harness.loglikelihood_rolling([request("loglikelihood_rolling", long)])[0]
    assert len(tokenizer.encode(long).ids) > 32 and math.isfinite(total) and total < 0


def test_tasks_are_paper_names_or_files_whose_own_tags_are_no_error(tmp_path: Path) -> None:
    assert len(resolve_tasks("paper")[0]) == 8
    tagged = tmp_path / "tagged.yaml"  # lm-eval's own tags (`!function`)
    tagged.write_text("task: tagged\nprocess_docs: !function utils.process_docs\n")
    assert resolve_tasks([str(tagged), "piqa"]) == (["tagged", "piqa"], [str(tmp_path)])
    task = write_local_task(tmp_path / "empty")
    (tmp_path / "empty" / "items.jsonl").write_text("")  # ended in StopIteration, an internal error
    with pytest.raises(UserError, match="^tasks: xsa_toy_mc: its data holds no items"):
        load_tasks(*resolve_tasks([str(task)]))


def score(value: float, n: int = 6, stderr: float | None = None) -> dict[str, Score]:
    return {"t": Score(metric="acc", value=value, n=n, stderr=stderr)}


def row(checkpoint: str, attention: str, value: float, run: str | None = None) -> Row:
    run = run or Path(checkpoint).parent.parent.name
    return Row(checkpoint=checkpoint, attention=attention, run=run, scores=score(value), average=value)


def test_the_difference_is_of_the_arms_means_over_their_seeds():
    """Seeds of both arms (as a sweep's compare runs are evaluated): the row was the first XSA minus the first SA."""
    arms = [("xsa", 0.5), ("sa", 0.4), ("xsa", 0.7), ("sa", 0.2), ("sa", 0.3)]
    rows = [row(f"/runs/{a}{v}/checkpoints/last.ckpt", a, v) for a, v in arms]
    assert minus_baseline(rows, ["t"], "sa", "xsa") == {"t": pytest.approx(0.6 - 0.3), "average": pytest.approx(0.3)}
    assert minus_baseline(rows[1::2], ["t"], "sa", "xsa") is None  # no XSA checkpoint


def test_the_difference_has_an_interval_paired_over_items():
    """-10 points on 20 items printed without a word of its noise (one item is 5 points): XSA - SA has a t interval
    over the items both arms answered (seeds averaged first), the average's from the tasks' added in quadrature."""
    import scipy.stats

    sa = {0: 1.0, 1: 0.0, 2: 1.0, 3: 0.0, 4: 1.0, 5: 1.0}
    xsa = {0: 1.0, 1: 1.0, 2: 1.0, 3: 0.0, 4: 0.0, 5: 1.0}
    other = {0: 0.0, 1: 0.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}  # a second SA seed, one more task
    rows = [row(f"/r/{a}/last.ckpt", a, 0.5, run=a) for a in ("sa", "xsa", "sa")]
    items = [{"a": sa, "b": sa}, {"a": xsa, "b": other}, {"a": other, "b": xsa}]
    intervals = paired_intervals(rows, items, ["a", "b"], "sa", "xsa")
    diffs = {t: [items[1][t][d] - (items[0][t][d] + items[2][t][d]) / 2 for d in range(6)] for t in ("a", "b")}
    for task in ("a", "b"):
        ci = scipy.stats.ttest_1samp(diffs[task], 0.0).confidence_interval(0.95)
        assert intervals[task] == pytest.approx([ci.low, ci.high])
    half = math.sqrt(sum(((intervals[t][1] - intervals[t][0]) / 2) ** 2 for t in ("a", "b"))) / 2
    centre = (sum(diffs["a"]) + sum(diffs["b"])) / 12
    assert intervals["average"] == pytest.approx([centre - half, centre + half])
    same = [{"a": sa}, {"a": sa}]
    assert paired_intervals(rows[:2], same, ["a"], "sa", "xsa") == {
        "a": None,
        "average": None,
    }  # no spread: no interval


def test_eval_md():
    """eval.md, as eval.json reads back: each score with n and its standard error; two checkpoints of one run told
    apart by their files, and the mean that counts both warned of; runs of one name in other folders told apart by
    their paths; XSA - SA of the arms' means with its interval; what a limit ran."""
    runs = [("/r/sa_run/checkpoints/last.ckpt", "sa", 0.425), ("/r/sa_run/checkpoints/step-000010.ckpt", "sa", 0.45)]
    runs += [("/a/xsa/checkpoints/last.ckpt", "xsa", 0.5), ("/b/xsa/checkpoints/last.ckpt", "xsa", 0.55)]
    rows = [replace(row(*r), scores=score(r[2], n=20, stderr=0.11 if i else None)) for i, r in enumerate(runs)]
    result = EvalResult(tasks=["t"], limit=0.5, rows=rows, xsa_minus_sa=minus_baseline(rows, ["t"], "sa", "xsa"))
    result = replace(result, xsa_minus_sa_ci95={"t": [-0.25, 0.05], "average": None})
    assert_golden("eval_report.md", render(EvalResult.from_json(json.loads(json.dumps(result.to_json())))))
    one_each = EvalResult(
        tasks=["t"], limit=3, rows=rows[1:3], xsa_minus_sa=minus_baseline(rows[1:3], ["t"], "sa", "xsa")
    )
    assert_golden("eval_report_limit.md", render(one_each))


BASELINES = {  # the checkpoints' arms, baseline -> refused (it would compare nothing)
    "sa over sa and xsa": (["sa", "xsa"], "sa", False),
    "xsa over sa and xsa": (["sa", "xsa"], "xsa", False),
    "the default over one arm": (["xsa"], "sa", False),
    "a set baseline absent, one arm": (["sa"], "xsa", True),
    "the default absent, two arms": (["xsa", "xsa_gated"], "sa", True),
}


@pytest.mark.parametrize("arms, baseline, refused", BASELINES.values(), ids=BASELINES.keys())
def test_a_baseline_that_would_compare_nothing_is_refused(tmp_path: Path, arms: list[str], baseline: str, refused):
    ckpts = []
    for i, arm in enumerate(arms):
        (run := tmp_path / f"run{i}" / "checkpoints").mkdir(parents=True)
        (run.parent / "config.yaml").write_text(f"attention:\n  name: {arm}\n")
        ckpts.append(str(run / "last.ckpt"))
    if refused:
        with pytest.raises(UserError, match=f"^baseline={baseline} would compare nothing: the checkpoints are of "):
            check_baseline(ckpts, baseline)
    else:
        check_baseline(ckpts, baseline)
