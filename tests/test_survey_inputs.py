"""Inputs a new user tried (the survey of every command) whose fix lives outside the other tests' modules."""

import sys

import pytest

from xsa_lm import __version__, cli

CASES = {  # argv after `xsa-lm` -> (exit code, what stdout says)
    "--version": (["--version"], 0, f"xsa-lm {__version__}\n"),
    "-V": (["-V"], 0, f"xsa-lm {__version__}\n"),
}


@pytest.mark.parametrize("argv, code, stdout", CASES.values(), ids=CASES.keys())
def test_survey_input(
    argv: list[str], code: int, stdout: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
):
    monkeypatch.setattr(sys, "argv", ["xsa-lm", *argv])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    out = capsys.readouterr()
    assert (exit_.value.code, out.out, out.err) == (code, stdout, "")
