"""``fluxora-webhooks inbox`` refuses bad input with exit 2 and a message naming the option,
before it connects to anything (run in-process: no database is needed to refuse)."""

from __future__ import annotations

import pytest

from fluxora_webhooks import cli


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (("prune", "--older-than", "1h"), "--older-than"),  # shorter than the retry window
        (("prune", "--older-than", "30m"), "--older-than"),  # the typo for 30d
        (("prune", "--older-than", "soon"), "--older-than"),
        (("prune",), "--older-than"),
        (("prune", "--older-than", "30d", "--batch-size", "0"), "--batch-size"),
        (("prune", "--older-than", "30d", "--batch-size", "many"), "--batch-size"),
        ((), "ACTION"),
        (("rebuild",), "rebuild"),
    ],
)
def test_bad_input_exits_2_naming_the_option(
    args: tuple[str, ...], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = cli.main(["inbox", *args])
    except SystemExit as exc:  # argparse's own refusals
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2, err
    assert option in err
    assert "Traceback" not in err


def test_the_command_is_listed_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "inbox" in capsys.readouterr().out
