"""Each risk the simulator flags has its own documentation page, linked from docs/risks.md."""
from pathlib import Path

from twin.sim.risk import KINDS

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_every_flagged_risk_has_a_page():
    index = (DOCS / "risks.md").read_text()
    pages = {p.stem: p.read_text() for p in (DOCS / "risks").glob("*.md")}
    missing = []
    for kind in KINDS:
        page = next((name for name, text in pages.items() if name == kind or f"{kind}" in text.split("\n", 1)[0]), None)
        if page is None:
            missing.append(kind)
            continue
        assert f"risks/{page}.md" in index, f"docs/risks.md does not link {page}"
        body = pages[page]
        assert "Trigger" in body or "trigger" in body, f"{page}: say what triggers it"
    assert not missing, f"risks without a page: {missing}"
