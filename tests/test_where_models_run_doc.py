"""docs/where-models-run.md: every cell that names a test names one that exists in the file it names, and every
results file it cites is there, so the table cannot claim a check that was renamed or removed."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "where-models-run.md"


def table_cells() -> list[str]:
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| ") and "---" not in line]
    return [cell for row in rows[1:] for cell in re.split(r"(?<!\\)\|", row)[1:-1]]


def test_every_cell_says_what_checks_it_or_why_not():
    cells = table_cells()
    assert len(cells) == 8 * 6
    for cell in cells[1::6] + cells[2::6] + cells[3::6] + cells[4::6] + cells[5::6]:  # the client columns
        assert re.search(r"tests/|bench/results/|not tested|not run|^ ?no\b", cell), cell


def test_the_tests_and_results_cited_exist():
    cited = 0
    for cell in table_cells():
        test_file = None
        for match in re.finditer(r"(tests/\w+\.py|bench/results/[\w.-]+\.json)|`(test_\w+)`", cell):
            if match.group(1) and match.group(1).startswith("bench/"):
                assert (REPO / match.group(1)).is_file(), match.group(1)
            elif match.group(1):
                test_file = REPO / match.group(1)
                assert test_file.is_file(), match.group(1)
            else:
                assert test_file is not None, cell
                assert f"def {match.group(2)}(" in test_file.read_text(), (test_file.name, match.group(2))
                cited += 1
    assert cited >= 12
