"""bench/lib/report.py writes benches' subsections into docs/benchmarks.md."""

from __future__ import annotations

from pathlib import Path

from bench.lib import report


def test_subsections_are_kept_in_natural_order_and_others_are_left_as_they_are(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Other\n\nkept\n\n## Cluster\n\nold intro\n\n### (a10) ten\n\nx\n\n"
                   "### (a) first\n\ny\n\n### (a2) two\n\nz\n")
    report.write_subsections(doc, "## Cluster", ["new intro"], {"(a2)": ["### (a2) two, again", "", "w"]})
    text = doc.read_text()
    assert "## Other\n\nkept" in text and "new intro" in text and "old intro" not in text
    heads = [line for line in text.splitlines() if line.startswith("### ")]
    # "(a10)" after "(a2)": a string sort put it first and moved every later subsection on a rewrite
    assert heads == ["### (a) first", "### (a2) two, again", "### (a10) ten"]
