"""docs/BENCHMARKS.md's first table and its picture come from the same results files (tools/plot_benchmarks.py)."""

from pathlib import Path

import pytest

from tools import plot_benchmarks

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"


def test_todays_table_matches_the_results_files():
    text = (REPO / "docs" / "BENCHMARKS.md").read_text()
    assert text.startswith("# Benchmarks\n\n## Today's figures\n")
    table = text.split("## History")[0]
    rows = [line for line in table.splitlines() if line.startswith("| gpt-oss")]
    for r in plot_benchmarks.current(RESULTS):
        ceiling = plot_benchmarks.ceiling(r["model"], r["job"], r["copy_TBps"])
        want = (
            f"**{r['tok_s']:,.0f}**",
            f"`{r['commit']}`",
            f"{ceiling:,.0f}",
            f"{r['copy_TBps']:.2f} TB/s",
            f"{r['tpot_ms']:.2f} ms",
        )
        mine = [row for row in rows if row.split(" | ")[-1].strip(" |`") == r["file"]]  # a file may hold several jobs
        assert any(all(w in row for w in want) for row in mine), (r, mine)


@pytest.mark.slow  # draws both pictures
def test_pictures_are_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    plot_benchmarks.main(["--results", str(RESULTS), "--out", str(tmp_path)])
    for name in ("benchmarks_curves.png", "benchmarks_history.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
