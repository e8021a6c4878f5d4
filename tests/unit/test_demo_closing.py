"""The demo's closing lines say why the dashboard was not kept running: --serve not given,
or given with an output that is not a terminal (`make demo | tee log`)."""

from __future__ import annotations

import pytest

from fluxora_webhooks.demo.dashboard import describe

URL, TOKEN = "http://127.0.0.1:8080/", "fxa_example"


@pytest.mark.parametrize(
    ("serving", "asked", "said", "not_said"),
    [
        (True, True, "Serving until Ctrl-C.", "Not kept running"),
        (False, True, "--serve keeps it only when the output is a terminal", "demo --serve`"),
        (False, False, "keep it with `fluxora-webhooks demo --serve` (in a terminal)", "only"),
    ],
    ids=["served", "asked, not a terminal", "not asked"],
)
def test_the_closing_line_says_why(serving: bool, asked: bool, said: str, not_said: str) -> None:
    text = "\n".join(map(str, describe(URL, TOKEN, serving, asked=asked)))
    assert said in text and not_said not in text, text
    assert f"Admin token (shown once): {TOKEN}" in text
