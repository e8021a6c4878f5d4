from __future__ import annotations

from fluxora_webhooks.queries import expand_uses, parse_blocks, query


def test_named_blocks_are_parsed() -> None:
    blocks = parse_blocks("-- name: a\nSELECT 1;\n\n-- name: b\n-- a comment\nSELECT 2;\n")
    assert blocks == {"a": "SELECT 1", "b": "-- a comment\nSELECT 2"}


def test_the_claim_is_the_design_documents() -> None:
    claim = " ".join(query("claim_due").split())
    assert "WHERE processed = false AND created_at <= now()" in claim
    assert "ORDER BY created_at ASC, id ASC" in claim
    assert "FOR UPDATE SKIP LOCKED" in claim


def test_a_use_line_is_replaced_by_the_named_fragment_indented_as_it() -> None:
    blocks = parse_blocks(
        "-- name: frag\nINSERT INTO t\nSELECT 1\n\n"
        "-- name: stmt\nWITH x AS (\n    -- use: frag\n    RETURNING id\n)\nSELECT 1;\n"
    )
    assert expand_uses(blocks)["stmt"] == (
        "WITH x AS (\n    INSERT INTO t\n    SELECT 1\n    RETURNING id\n)\nSELECT 1"
    )


def test_both_fan_out_statements_insert_the_same_rows() -> None:
    fragment = query("fan_out_insert")
    assert "md5(ev.delivery_id::text" in fragment
    for name in ("route_events", "complete_batch"):
        assert fragment.splitlines()[0] in query(name) and "-- use:" not in query(name)
