"""docs/config.md's field table is the model's own, kept current."""

from __future__ import annotations

from pathlib import Path

from iop.edgeconfig.documenting import field_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_the_field_table_in_the_docs_is_current() -> None:
    text = DOC.read_text()
    table = text.split("<!-- fields:begin -->\n", 1)[1].split("<!-- fields:end -->", 1)[0]
    assert table == field_table(), "regenerate the table in docs/config.md (see its header)"


def test_every_leaf_field_is_in_the_table() -> None:
    table = field_table()
    for path in (
        "`nodes[].providers[].long_context_slots`",
        "`openai.principal_tokens[].token_hash_sha256`",
        "`nodes[].providers[].adapter.(type=openai).api_key_env`",
        "`models[].generation.max_tokens`",
    ):
        assert path in table
