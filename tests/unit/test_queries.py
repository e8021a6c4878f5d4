from __future__ import annotations

from fluxora_webhooks.queries import parse_blocks, query


def test_named_blocks_are_parsed() -> None:
    blocks = parse_blocks("-- name: a\nSELECT 1;\n\n-- name: b\n-- a comment\nSELECT 2;\n")
    assert blocks == {"a": "SELECT 1", "b": "-- a comment\nSELECT 2"}


def test_the_claim_is_the_design_documents() -> None:
    claim = " ".join(query("claim_due").split())
    assert "WHERE processed = false AND created_at <= now()" in claim
    assert "ORDER BY created_at ASC, id ASC" in claim
    assert "FOR UPDATE SKIP LOCKED" in claim
