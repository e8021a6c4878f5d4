"""A secret that starts with "-" given as ``--secret VALUE``: argparse alone takes any word
that starts with "-" for an option ("expected one argument"), and
``secrets.token_urlsafe`` (examples/README.md's recipe) starts one secret in 64 so."""

from __future__ import annotations

import argparse

import pytest

from fluxora_webhooks import cli

DASHED = "-RqHswvnU6VTcfC41dLkd27GIJ2YyDVKO4mThEAwi_Y"


def parse(*argv: str) -> argparse.Namespace:
    parser = cli.build_parser()
    return parser.parse_args(cli.join_dash_values(argv, cli.known_options(parser)))


@pytest.mark.parametrize(
    "argv",
    [
        ("endpoints", "add", "--url", "https://a.example/", "--secret", DASHED),
        ("endpoints", "add", "--secret", DASHED, "--url", "https://a.example/", "--json"),
        ("endpoints", "add", "--url", "https://a.example/", f"--secret={DASHED}"),
        ("endpoints", "rotate-secret", "ep_x", "--secret", DASHED, "--keep-previous", "1h"),
    ],
)
def test_a_secret_that_starts_with_a_dash_is_taken(argv: tuple[str, ...]) -> None:
    assert parse(*argv).secret == DASHED


@pytest.mark.parametrize("secret", ["--" + "k" * 40, "-h" + "k" * 40, "-1234", "-a=b"])
def test_any_word_that_is_no_option_is_taken_as_the_secret(secret: str) -> None:
    assert parse("endpoints", "rotate-secret", "ep_x", "--secret", secret).secret == secret


@pytest.mark.parametrize(
    "argv",
    [
        # A value forgotten: the next option is not taken for the secret.
        ("endpoints", "add", "--url", "https://a.example/", "--secret", "--json"),
        ("endpoints", "add", "--secret", "--url", "https://a.example/"),
        ("endpoints", "add", "--secret", "--url=https://a.example/"),
        ("endpoints", "add", "--url", "https://a.example/", "--secret", "--js"),  # --json
        ("endpoints", "add", "--url", "https://a.example/", "--secret", "-h"),
        ("endpoints", "add", "--url", "https://a.example/", "--secret"),
    ],
)
def test_an_option_after_secret_is_still_an_option(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(*argv)
    assert exited.value.code == 2
    assert "argument --secret: expected one argument" in capsys.readouterr().err


def test_words_after_a_double_dash_are_left_as_they_are() -> None:
    known = cli.known_options(cli.build_parser())
    argv = ["demo", "--", "--secret", DASHED]
    assert cli.join_dash_values(argv, known) == argv
    assert cli.join_dash_values(["--secret", DASHED], known) == [f"--secret={DASHED}"]
    assert {"--secret", "--url", "--json", "--keep-previous", "-h"} <= known
