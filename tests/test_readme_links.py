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
