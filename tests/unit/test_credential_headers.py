"""Which custom headers' values are credentials, never shown (docs/security.md), and the
mask given back keeping the stored value."""

from __future__ import annotations

import pytest

from fluxora_webhooks.endpoints import (
    HIDDEN_HEADER_VALUE,
    credential_header,
    resolve_hidden_headers,
    shown_headers,
)
from fluxora_webhooks.errors import ConfigError

HIDDEN = (
    "Authorization", "authorization", "Proxy-Authorization", "X-Api-Key", "Api_Key",
    "X-ApiKey", "X-Auth-Token", "X-AuthToken", "X-Auth", "Cookie", "X-Client-Secret",
    "X-Hub-Signature", "X-Sig", "X-Session-Id", "X-Password", "X-Jwt", "X-Otp", "Bearer",
    "Authentication", "X-Authentication", "X-Api-Keys", "X-Creds", "X-Passcode",
)  # fmt: skip
SHOWN = ("X-Team", "X-Author", "X-Monkey", "X-Signal", "X-Passenger", "X-Design", "X-Keyboard")


@pytest.mark.parametrize("name", HIDDEN)
def test_a_credential_header_is_hidden(name: str) -> None:
    assert credential_header(name)
    assert shown_headers({name: "v-1"}) == {name: HIDDEN_HEADER_VALUE}


@pytest.mark.parametrize("name", SHOWN)
def test_another_header_is_shown(name: str) -> None:
    assert not credential_header(name)
    assert shown_headers({name: "v-1"}) == {name: "v-1"}
    # Its value may be the mask's text itself: it is a value like any other.
    assert resolve_hidden_headers({name: HIDDEN_HEADER_VALUE}, {}) == {name: HIDDEN_HEADER_VALUE}


def test_the_mask_keeps_the_stored_value_whatever_the_case_and_a_new_one_is_refused() -> None:
    stored = {"Authorization": "Bearer t-1", "X-Team": "blue"}
    assert resolve_hidden_headers(
        {"authorization": HIDDEN_HEADER_VALUE, "X-Team": "red"}, stored
    ) == {"authorization": "Bearer t-1", "X-Team": "red"}
    with pytest.raises(ConfigError, match=r"X-Api-Key: \*{8} stands for a stored value"):
        resolve_hidden_headers({"X-Api-Key": HIDDEN_HEADER_VALUE}, stored)
    assert shown_headers({"Authorization": ""}) == {"Authorization": ""}  # nothing to hide
