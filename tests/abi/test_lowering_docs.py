"""docs/lowering.md: its example runs as printed, and it names every validation rule."""
import contextlib
import io
import re
from pathlib import Path

from twin.abi.lowering import RULES

DOC = Path(__file__).resolve().parents[2] / "docs" / "lowering.md"


def test_the_example_runs_and_prints_what_its_comments_say():
    text = DOC.read_text()
    code = re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(DOC), "exec"), {})
    promised = [line.split("# ", 1)[1].strip() for line in code.splitlines() if "print(" in line and "# " in line]
    assert out.getvalue().split("\n")[:len(promised)] == promised


def test_every_rule_is_documented():
    text = DOC.read_text()
    assert all(f"`{rule}`" in text for rule in RULES)
