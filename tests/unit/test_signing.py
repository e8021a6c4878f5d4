"""Signing and verification: both schemes, rotation, and interoperability with the
``standardwebhooks`` package (the reference implementation of the standard)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from multidict import CIMultiDict
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from fluxora_webhooks.endpoints import check_secret
from fluxora_webhooks.errors import ConfigError, VerificationError
from fluxora_webhooks.settings import Settings
from fluxora_webhooks.signing import Signer, standard_key, verify

SECRET = b"s3cret-key-for-tests-0123456789"
OLD = b"old-secret-for-tests-0123456789"
NEW = b"new-secret-for-tests-0123456789"
BODY = b'{"amount": 12, "stream_id": "s-1"}'
DELIVERY_ID = "9f1c3a52-3c1b-4d8e-9a57-0d9d3c1f0a11"
NOW = 1_750_000_000

STANDARD_HEADERS = ("webhook-id", "webhook-timestamp", "webhook-signature")
FLUXORA_HEADERS = ("x-fluxora-delivery-id", "x-fluxora-timestamp", "x-fluxora-signature")


def signed(
    secret: bytes = SECRET,
    *,
    previous: bytes | None = None,
    body: bytes = BODY,
    delivery_id: str = DELIVERY_ID,
    timestamp: int = NOW,
) -> dict[str, str]:
    return Signer(secret, previous).headers(
        delivery_id=delivery_id,
        event_type="stream.updated",
        attempt=1,
        body=body,
        timestamp=timestamp,
    )


def fluxora_only(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if not k.startswith("webhook-")}


def standard_only(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if not k.startswith("x-fluxora-")}


def whsec(secret: bytes) -> str:
    return "whsec_" + base64.b64encode(secret).decode()


def reason_of(body: bytes, headers: object, secret: str | bytes = SECRET, **kw: object) -> str:
    with pytest.raises(VerificationError) as caught:
        verify(body, headers, secret, now=NOW, **kw)  # type: ignore[arg-type]
    message = str(caught.value)
    for s in (SECRET, OLD, NEW):
        assert s.decode() not in message
        assert s.decode() not in repr(caught.value.args)
    return caught.value.reason


# --- the wire format -------------------------------------------------------------------------


def test_headers_carry_the_wire_format_of_both_schemes() -> None:
    h = signed()
    assert h["x-fluxora-delivery-id"] == h["webhook-id"] == DELIVERY_ID
    assert h["x-fluxora-timestamp"] == h["webhook-timestamp"] == str(NOW)
    expected_hex = hmac.new(SECRET, f"{NOW}.".encode() + BODY, hashlib.sha256).hexdigest()
    assert h["x-fluxora-signature"] == expected_hex
    standard = hmac.new(SECRET, f"{DELIVERY_ID}.{NOW}.".encode() + BODY, hashlib.sha256)
    assert h["webhook-signature"] == "v1," + base64.b64encode(standard.digest()).decode()
    assert h["x-fluxora-attempt"] == "1"
    assert h["x-fluxora-event"] == "stream.updated"
    assert h["content-type"] == "application/json"
    assert h["user-agent"].startswith("fluxora-webhooks/")


def test_signer_with_previous_lists_both_standard_signatures_and_one_fluxora_digest() -> None:
    h = signed(NEW, previous=OLD)
    entries = h["webhook-signature"].split(" ")
    assert len(entries) == 2
    assert entries[0] == signed(NEW)["webhook-signature"]
    assert entries[1] == signed(OLD)["webhook-signature"]
    assert h["x-fluxora-signature"] == signed(NEW)["x-fluxora-signature"]


def test_standard_key_decodes_whsec_secrets_only() -> None:
    raw = bytes(range(32))
    assert standard_key(whsec(raw).encode()) == raw
    assert standard_key(b"plain-secret") == b"plain-secret"
    assert standard_key(b"whsec_not base64!") == b"whsec_not base64!"


# --- verify: success --------------------------------------------------------------------------


@pytest.mark.parametrize("secret", [SECRET, SECRET.decode()], ids=["bytes", "str"])
def test_verify_returns_the_delivery_id_for_either_scheme(secret: str | bytes) -> None:
    h = signed()
    assert verify(BODY, h, secret, now=NOW) == DELIVERY_ID
    assert verify(BODY, standard_only(h), secret, now=NOW) == DELIVERY_ID
    assert verify(BODY, fluxora_only(h), secret, now=NOW) == DELIVERY_ID


def test_verify_prefers_standard_webhooks_when_webhook_signature_is_present() -> None:
    h = signed()
    h["x-fluxora-signature"] = "0" * 64  # would fail if it were the one checked
    assert verify(BODY, h, SECRET, now=NOW) == DELIVERY_ID
    h = signed()
    h["webhook-signature"] = "v1," + base64.b64encode(b"\0" * 32).decode()
    assert reason_of(BODY, h) == "no_matching_signature"


def test_header_names_are_case_insensitive() -> None:
    h = signed()
    assert verify(BODY, {k.upper(): v for k, v in h.items()}, SECRET, now=NOW) == DELIVERY_ID
    title = {k.title(): v for k, v in fluxora_only(h).items()}
    assert verify(BODY, title, SECRET, now=NOW) == DELIVERY_ID
    assert verify(BODY, CIMultiDict(h), SECRET, now=NOW) == DELIVERY_ID


def test_raw_bytes_header_values_are_accepted() -> None:
    h = {k.encode(): v.encode() for k, v in signed().items()}
    assert verify(BODY, h, SECRET, now=NOW) == DELIVERY_ID  # type: ignore[arg-type]


def test_whsec_secret_keys_the_standard_scheme_with_its_decoded_bytes() -> None:
    secret = whsec(bytes(range(24))).encode()
    h = signed(secret)
    assert verify(BODY, standard_only(h), secret.decode(), now=NOW) == DELIVERY_ID
    assert verify(BODY, fluxora_only(h), secret, now=NOW) == DELIVERY_ID
    assert Webhook(secret.decode()).verify(
        BODY, standard_only(signed(secret, timestamp=int(time.time())))
    )


def test_timestamp_tolerance_is_inclusive_on_both_sides() -> None:
    for scheme in (standard_only, fluxora_only):
        assert verify(BODY, scheme(signed(timestamp=NOW - 300)), SECRET, now=NOW)
        assert verify(BODY, scheme(signed(timestamp=NOW + 300)), SECRET, now=NOW)
        assert verify(BODY, scheme(signed(timestamp=NOW - 10)), SECRET, now=NOW, tolerance=10)


def test_verify_uses_the_current_time_by_default() -> None:
    h = signed(timestamp=int(time.time()))
    assert verify(BODY, h, SECRET) == DELIVERY_ID
    with pytest.raises(VerificationError) as caught:
        verify(BODY, signed(timestamp=NOW), SECRET)  # NOW is in 2025
    assert caught.value.reason == "timestamp_too_old"


def test_comparison_is_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    h = signed()
    verify(BODY, standard_only(h), SECRET, now=NOW)
    verify(BODY, fluxora_only(h), SECRET, now=NOW)
    assert len(calls) == 2
    with pytest.raises(VerificationError):
        verify(BODY + b" ", fluxora_only(h), SECRET, now=NOW)
    assert len(calls) == 3


# --- verify: failures -------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", [standard_only, fluxora_only])
def test_tampered_body_wrong_secret_and_stale_or_future_timestamps_fail(scheme) -> None:  # type: ignore[no-untyped-def]
    h = scheme(signed())
    assert reason_of(BODY + b" ", h) == "no_matching_signature"
    assert reason_of(BODY.replace(b"12", b"13"), h) == "no_matching_signature"
    assert reason_of(BODY, h, secret=b"another-secret-entirely-0000") == "no_matching_signature"
    assert reason_of(BODY, scheme(signed(timestamp=NOW - 301))) == "timestamp_too_old"
    assert reason_of(BODY, scheme(signed(timestamp=NOW + 301))) == "timestamp_too_new"
    assert reason_of(BODY, scheme(signed(timestamp=NOW - 11)), tolerance=10) == "timestamp_too_old"


def test_a_replayed_timestamp_with_a_fresh_header_fails() -> None:
    old = signed(timestamp=NOW - 3600)
    for name in ("webhook-timestamp", "x-fluxora-timestamp"):
        forged = dict(old, **{name: str(NOW)})
        scheme = standard_only if name.startswith("webhook") else fluxora_only
        assert reason_of(BODY, scheme(forged)) == "no_matching_signature"


def test_a_standard_signature_for_another_delivery_id_fails() -> None:
    other = signed(delivery_id="another-delivery")
    forged = dict(standard_only(signed()), **{"webhook-signature": other["webhook-signature"]})
    assert reason_of(BODY, forged) == "no_matching_signature"
    relabelled = dict(standard_only(other), **{"webhook-id": DELIVERY_ID})
    assert reason_of(BODY, relabelled) == "no_matching_signature"


@pytest.mark.parametrize("missing", STANDARD_HEADERS[:2])
def test_missing_standard_headers(missing: str) -> None:
    h = standard_only(signed())
    del h[missing]
    assert reason_of(BODY, h) == "missing_header"


@pytest.mark.parametrize("missing", FLUXORA_HEADERS)
def test_missing_fluxora_headers(missing: str) -> None:
    h = fluxora_only(signed())
    del h[missing]
    assert reason_of(BODY, h) == "missing_header"


def test_no_headers_at_all() -> None:
    assert reason_of(BODY, {}) == "missing_header"
    assert reason_of(BODY, {"webhook-id": "x", "x-fluxora-timestamp": str(NOW)}) == "missing_header"


@pytest.mark.parametrize(
    "value",
    [
        "",
        " ",
        "abc",
        "-5",
        "+1750000000",
        "1750000000.5",
        "1e9",
        "1_750_000_000",
        "\u0661\u0667\u0665\u0660",
        "9" * 17,
        "0x10",
        "17500000 00",
    ],
)
def test_bad_timestamps(value: str) -> None:
    for name, scheme in (
        ("webhook-timestamp", standard_only),
        ("x-fluxora-timestamp", fluxora_only),
    ):
        h = scheme(signed())
        h[name] = value
        expected = "missing_header" if not value.strip() else "bad_timestamp"
        assert reason_of(BODY, h) == expected


@pytest.mark.parametrize(
    "value",
    [
        "",
        "  ",
        "garbage",
        "v1",
        "v1,",
        "v1,!!!!",
        "v2," + base64.b64encode(b"\0" * 32).decode(),
        "v1," + base64.b64encode(b"short").decode(),
        "v1a,abc v0,xyz",
    ],
)
def test_malformed_webhook_signature(value: str) -> None:
    h = standard_only(signed())
    h["webhook-signature"] = value
    # Empty is missing, as for every other required header (docs/security.md).
    assert reason_of(BODY, h) == ("missing_header" if not value.strip() else "bad_signature")


def test_one_good_entry_among_unknown_versions_and_garbage_is_enough() -> None:
    h = standard_only(signed())
    h["webhook-signature"] = "v2,abc garbage v1,!!! " + h["webhook-signature"] + " v1a,zz"
    assert verify(BODY, h, SECRET, now=NOW) == DELIVERY_ID


@pytest.mark.parametrize("value", ["", "zz" * 32, "ab" * 31, "ab" * 33, "v1,abc"])
def test_malformed_fluxora_signature(value: str) -> None:
    h = fluxora_only(signed())
    h["x-fluxora-signature"] = value
    assert reason_of(BODY, h) == ("missing_header" if value == "" else "bad_signature")


def test_uppercase_hex_is_the_same_digest() -> None:
    h = fluxora_only(signed())
    h["x-fluxora-signature"] = h["x-fluxora-signature"].upper()
    assert verify(BODY, h, SECRET, now=NOW) == DELIVERY_ID


@pytest.mark.parametrize(
    "headers",
    [
        None,
        42,
        "webhook-id: x",
        [("webhook-id", "x")],
        {"webhook-signature": None},
        {"webhook-signature": 5, "webhook-id": "x", "webhook-timestamp": str(NOW)},
        {"x-fluxora-signature": ["a"], "x-fluxora-timestamp": NOW, "x-fluxora-delivery-id": 1},
        {1: "x", None: "y", ("a", "b"): "z"},
    ],
)
def test_garbage_headers_only_raise_verification_error(headers: object) -> None:
    reason_of(BODY, headers)


def test_non_text_values_count_as_invalid() -> None:
    h: dict[str, object] = dict(standard_only(signed()))
    h["webhook-timestamp"] = NOW
    assert reason_of(BODY, h) == "missing_header"
    h = dict(standard_only(signed()))
    h["webhook-signature"] = [h["webhook-signature"]]
    assert reason_of(BODY, h) == "bad_signature"


def test_non_ascii_and_huge_values_only_raise_verification_error() -> None:
    h = standard_only(signed())
    for name in STANDARD_HEADERS:
        for value in ("é\u202e\udcff", "x" * 1_000_000, "v1," + "A" * 1_000_000):
            reason_of(BODY, dict(h, **{name: value}))
    many = " ".join(["v1," + base64.b64encode(b"\1" * 32).decode()] * 100_000)
    assert reason_of(BODY, dict(h, **{"webhook-signature": many})) == "no_matching_signature"
    f = fluxora_only(signed())
    for name in FLUXORA_HEADERS[1:]:
        for value in ("é\u202e\udcff", "7" * 1_000_000):
            reason_of(BODY, dict(f, **{name: value}))


def test_a_non_ascii_delivery_id_round_trips() -> None:
    h = signed(delivery_id="dé-1")
    assert verify(BODY, h, SECRET, now=NOW) == "dé-1"
    assert verify(BODY, fluxora_only(h), SECRET, now=NOW) == "dé-1"
    lone = dict(standard_only(h), **{"webhook-id": "\ud800"})
    assert reason_of(BODY, lone) == "no_matching_signature"


def test_caller_mistakes_are_programming_errors_not_verification_failures() -> None:
    h = signed()
    with pytest.raises(ValueError):
        verify(BODY, h, b"", now=NOW)
    with pytest.raises(TypeError):
        verify(BODY, h, 123, now=NOW)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        verify(BODY.decode(), h, SECRET, now=NOW)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        verify(BODY, h, SECRET, now=NOW, tolerance=-1)
    # A clock that is not a time: an hour-old signature verified against NaN (every
    # comparison with NaN is false, so no timestamp was too old or too new).
    stale = signed(timestamp=NOW - 3600)
    for now in (float("nan"), float("inf"), "1700000000", True):
        with pytest.raises(ValueError, match="now must be a finite number"):
            verify(BODY, stale, SECRET, now=now)  # type: ignore[arg-type]
    assert reason_of(BODY, stale) == "timestamp_too_old"
    assert verify(BODY, signed(), SECRET, now=float(NOW)) == DELIVERY_ID
    assert verify(BODY, signed(), SECRET, now=Decimal(NOW)) == DELIVERY_ID  # type: ignore[arg-type]


# whsec_ secrets whose rest is not strict, padded base64: the sender refuses each one.
KEY = bytes(range(32))
BAD_WHSEC = {
    "unpadded": whsec(KEY).rstrip("="),
    "not base64": "whsec_" + "not base64 at all!" * 3,
    "a trailing newline": whsec(KEY) + "\n",
    "a space inside": whsec(KEY)[:20] + " " + whsec(KEY)[20:],
    "non-ASCII": "whsec_" + "\u00e9" * 44,
}


@pytest.mark.parametrize("case", sorted(BAD_WHSEC))
def test_a_whsec_secret_the_sender_refuses_is_refused_by_verify_too(case: str) -> None:
    """Taken as raw bytes, such a secret matched no signature the sender could make (the
    sender refuses it) and no other library's key: a ValueError names the mistake at once,
    as for whsec_ alone, without the secret in the message."""
    bad = BAD_WHSEC[case]
    with pytest.raises(ConfigError, match="not valid base64"):
        check_secret(bad)  # endpoints add, rotate-secret, the API
    with pytest.raises(ConfigError, match="WEBHOOK_SECRET: starts with whsec_ but the rest"):
        Settings.from_env({"WEBHOOK_URL": "https://hooks.example.com/in", "WEBHOOK_SECRET": bad})
    h = signed()
    for kw in ({"secret": bad}, {"secret": bad.encode()}, {"secret": SECRET, "previous": bad}):
        with pytest.raises(ValueError, match="whsec_ but the rest is not valid base64") as caught:
            verify(BODY, h, now=NOW, **kw)
        assert bad[len("whsec_") :].strip() not in str(caught.value)
        assert not isinstance(caught.value, VerificationError)  # the caller's, not the request's


@pytest.mark.parametrize("size", [31, 32, 33], ids=["two pads", "one pad", "no pad"])
def test_a_whsec_secret_the_sender_accepts_is_the_standardwebhooks_packages_key(
    size: int,
) -> None:
    secret = whsec(bytes(range(100, 100 + size)))
    assert check_secret(secret) == secret
    h = fresh(secret.encode())
    assert Webhook(secret).verify(BODY, h) == json.loads(BODY)
    assert verify(BODY, h, secret) == verify(BODY, standard_only(h), secret) == DELIVERY_ID
    ts = datetime.now(tz=UTC).replace(microsecond=0)
    theirs = {
        "webhook-id": DELIVERY_ID,
        "webhook-timestamp": str(int(ts.timestamp())),
        "webhook-signature": Webhook(secret).sign(DELIVERY_ID, ts, BODY.decode()),
    }
    assert verify(BODY, theirs, secret) == DELIVERY_ID


def test_messages_name_no_secret_even_when_the_secret_is_in_the_request() -> None:
    h = standard_only(signed())
    for name in STANDARD_HEADERS:
        reason_of(BODY, dict(h, **{name: SECRET.decode()}))
    reason_of(SECRET, h)


# --- rotation ---------------------------------------------------------------------------------


def test_rotation_standard_webhooks_consumers_on_either_secret_verify() -> None:
    h = standard_only(signed(NEW, previous=OLD))
    assert verify(BODY, h, NEW, now=NOW) == DELIVERY_ID
    assert verify(BODY, h, OLD, now=NOW) == DELIVERY_ID
    assert reason_of(BODY, h, secret=b"unrelated-secret-000000000") == "no_matching_signature"


def test_previous_is_accepted_for_either_scheme_on_its_own() -> None:
    h = signed(OLD)  # a request from a dispatcher still on the old secret
    assert verify(BODY, standard_only(h), NEW, previous=OLD, now=NOW) == DELIVERY_ID
    assert verify(BODY, fluxora_only(h), NEW, previous=OLD, now=NOW) == DELIVERY_ID
    assert reason_of(BODY, standard_only(h), secret=NEW) == "no_matching_signature"
    assert reason_of(BODY, fluxora_only(h), secret=NEW) == "no_matching_signature"


def test_rotation_fluxora_consumers_accept_both_secrets_first() -> None:
    during = fluxora_only(signed(NEW, previous=OLD))
    before = fluxora_only(signed(OLD))
    # Step 1: the consumer accepts the new secret too; the sender still signs with the old.
    assert verify(BODY, before, OLD, previous=NEW, now=NOW) == DELIVERY_ID
    # Step 2: the sender switches; the same consumer configuration accepts it.
    assert verify(BODY, during, OLD, previous=NEW, now=NOW) == DELIVERY_ID
    # Step 3: the consumer makes the new secret current, still accepting the old one.
    assert verify(BODY, during, NEW, previous=OLD, now=NOW) == DELIVERY_ID
    assert verify(BODY, before, NEW, previous=OLD, now=NOW) == DELIVERY_ID
    # The single x-fluxora digest uses the current secret: a consumer that skipped step 1
    # fails as soon as the sender switches. That is why consumers go first.
    assert reason_of(BODY, during, secret=OLD) == "no_matching_signature"


# --- interoperability with the standardwebhooks package ------------------------------------


def fresh(secret: bytes = SECRET, **kw: object) -> dict[str, str]:
    return signed(secret, timestamp=int(time.time()), **kw)  # type: ignore[arg-type]


def test_our_headers_verify_with_the_standardwebhooks_package() -> None:
    h = fresh()
    assert Webhook(whsec(SECRET)).verify(BODY, h) == json.loads(BODY)
    assert Webhook(SECRET).verify(BODY, h) == json.loads(BODY)  # bytes: the raw key
    assert verify(BODY, h, SECRET) == DELIVERY_ID


def _forgeries() -> dict[str, tuple[bytes, dict[str, str], bytes]]:
    h = fresh()
    other = fresh(delivery_id="another-delivery")
    now = int(time.time())
    return {
        "tampered body": (BODY.replace(b"12", b"13"), h, SECRET),
        "wrong secret": (BODY, h, b"another-secret-entirely-0000"),
        "stale timestamp": (BODY, signed(timestamp=now - 600), SECRET),
        "future timestamp": (BODY, signed(timestamp=now + 600), SECRET),
        "other delivery id": (
            BODY,
            dict(h, **{"webhook-signature": other["webhook-signature"]}),
            SECRET,
        ),
    }


@pytest.mark.parametrize(
    "case",
    ["tampered body", "wrong secret", "stale timestamp", "future timestamp", "other delivery id"],
)
def test_the_standardwebhooks_package_and_verify_reject_the_same_forgeries(case: str) -> None:
    body, headers, secret = _forgeries()[case]
    with pytest.raises(WebhookVerificationError):
        Webhook(whsec(secret)).verify(body, headers)
    with pytest.raises(VerificationError):
        verify(body, headers, secret)
    # The same request, unforged, passes both: the forgery is what fails.
    assert Webhook(whsec(SECRET)).verify(BODY, fresh())
    assert verify(BODY, fresh(), SECRET) == DELIVERY_ID


def test_signatures_made_by_the_standardwebhooks_package_verify_with_verify() -> None:
    ts = datetime.now(tz=UTC).replace(microsecond=0)
    sig = Webhook(whsec(SECRET)).sign(DELIVERY_ID, ts, BODY.decode())
    h = {
        "Webhook-Id": DELIVERY_ID,
        "Webhook-Timestamp": str(int(ts.timestamp())),
        "Webhook-Signature": sig,
    }
    assert verify(BODY, h, SECRET) == DELIVERY_ID
    assert verify(BODY, h, whsec(SECRET)) == DELIVERY_ID


def test_rotation_with_the_standardwebhooks_package() -> None:
    h = fresh(NEW, previous=OLD)
    assert Webhook(whsec(NEW)).verify(BODY, h)
    assert Webhook(whsec(OLD)).verify(BODY, h)
    with pytest.raises(WebhookVerificationError):
        Webhook(whsec(b"unrelated-secret-000000000")).verify(BODY, h)
    # Before the sender lists the new secret, a consumer already on it fails: consumers of
    # the standard switch only after every dispatcher sends both signatures.
    with pytest.raises(WebhookVerificationError):
        Webhook(whsec(NEW)).verify(BODY, fresh(OLD))


# The procedure of docs/security.md, step by step: at every step, every request any dispatcher
# may send (a rolling restart mixes two configurations) verifies with every consumer that may
# be in place at that step (consumers switch one by one).
ROTATION_STEPS = [
    # (step, sender configurations, x-fluxora consumers (secret, previous), standard consumers)
    ("0 before", [(OLD, None)], [(OLD, None)], [OLD]),
    ("1 consumers accept both", [(OLD, None)], [(OLD, None), (OLD, NEW)], [OLD]),
    ("2 sender lists both", [(OLD, None), (NEW, OLD)], [(OLD, NEW)], [OLD]),
    ("3 consumers move", [(NEW, OLD)], [(OLD, NEW), (NEW, OLD), (NEW, None)], [OLD, NEW]),
    ("4 sender drops old", [(NEW, OLD), (NEW, None)], [(NEW, OLD), (NEW, None)], [NEW]),
    ("5 after", [(NEW, None)], [(NEW, None)], [NEW]),
]


@pytest.mark.parametrize(("step", "senders", "fluxora", "standard"), ROTATION_STEPS)
def test_the_documented_rotation_never_fails_a_verification(
    step: str,
    senders: list[tuple[bytes, bytes | None]],
    fluxora: list[tuple[bytes, bytes | None]],
    standard: list[bytes],
) -> None:
    for secret, previous in senders:
        h = fresh(secret, previous=previous)
        for current, accepted in fluxora:
            assert verify(BODY, fluxora_only(h), current, previous=accepted) == DELIVERY_ID
            assert verify(BODY, h, current, previous=accepted) == DELIVERY_ID
        for key in standard:
            assert Webhook(whsec(key)).verify(BODY, standard_only(h)), (step, key)


def test_scheme_standard_refuses_a_request_stripped_to_the_fluxora_scheme() -> None:
    secret = b"scheme-choice-secret-0123456789abcdef"
    body = b'{"a":1}'
    headers = Signer(secret).headers(
        delivery_id="d-1", event_type="e", attempt=1, body=body, timestamp=1_800_000_000
    )
    stripped = {k: v for k, v in headers.items() if not k.startswith("webhook-")}
    assert verify(body, stripped, secret, now=1_800_000_000) == "d-1"  # auto: x-fluxora
    with pytest.raises(VerificationError) as info:
        verify(body, stripped, secret, now=1_800_000_000, scheme="standard")
    assert info.value.reason == "missing_header"
    assert verify(body, headers, secret, now=1_800_000_000, scheme="fluxora") == "d-1"
    assert verify(body, headers, secret, now=1_800_000_000, scheme="standard") == "d-1"
    with pytest.raises(ValueError, match="scheme"):
        verify(body, headers, secret, scheme="other")
