"""docs/interaction-matrix.md is the table tests/matrix/features.py generates: a feature, a
level or an exclusion added without regenerating the page fails here."""

from __future__ import annotations

from tests.matrix.features import DOC, render


def test_the_doc_is_the_generated_table() -> None:
    assert DOC.read_text() == render(), "run `python -m tests.matrix.features --write`"
