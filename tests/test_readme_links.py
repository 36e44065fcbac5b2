"""The README stands alone: every file it links or names is in the repository."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_points_only_to_files_in_the_repository():
    text = (ROOT / "README.md").read_text()
    assert "shared/" not in text
    links = re.findall(r"\]\(([^)#]+)\)", text)
    named = re.findall(r"`((?:docs|pipemem|bench|tests)/[\w./-]+\.(?:md|py|json))`", text)
    assert links, "the README links its docs"
    for path in links + named:
        if path.startswith("http"):
            continue
        assert (ROOT / path).exists(), path


def test_design_doc_is_linked_and_readme_maps_schedule_names():
    text = (ROOT / "README.md").read_text()
    assert (ROOT / "docs" / "DESIGN.md").is_file() and "](docs/DESIGN.md)" in text
    # the notation and the name mapping (pipemem / PyTorch / Paddle / paper) that
    # `pipemem schedule --help` prints, ZBH1 (Paddle's order) told apart from ZB1P (the paper's)
    assert "UPPER case" in text and "`F3.2`" in text and "`I3`/`W3`" in text
    assert (
        "| `ZBH1` | | `ZBH1` | ZB-H1 in Paddle's order" in text
        and "| `ZB1P` | | | ZB-H1 as the paper" in text
    )
    from pipemem.schedules import SCHEDULE_NAMES

    for name in SCHEDULE_NAMES:
        assert f"`{'auto' if name == 'ZBAuto' else name}`" in text, name


def test_paths_named_in_the_docs_exist():
    # a repository path named in any user doc (README, docs/, bench/data) is there; the one
    # exception is validation/cuda/, where `pipemem validate cuda` writes its results
    docs = [ROOT / "README.md", ROOT / "bench" / "data" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = []
    for doc in docs:
        text = doc.read_text(encoding="utf-8")
        assert "../shared" not in text and "/work/" not in text, doc.name
        for path in set(re.findall(r"(?<![\w/.])((?:pipemem|bench|tests|docs|\.ci)/[\w./-]*\w)", text)):
            if not (ROOT / path).exists() and not any((ROOT / path).parent.glob((ROOT / path).name + "*")):
                missing.append(f"{doc.name}: {path}")
    assert not missing, missing
