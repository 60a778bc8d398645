"""Every `dspark-twin` command a guide shows works as written (a new user follows only the page)."""
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# guides whose commands are cheap enough to run in the suite
GUIDES = ["docs/capacity.md", "README.md"]


def guide_commands(name):
    text = (ROOT / name).read_text()
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            for part in line.split("&&"):
                part = part.strip()
                if part.startswith("dspark-twin"):
                    yield part


CASES = [(g, c) for g in GUIDES for c in guide_commands(g)]


@pytest.mark.parametrize("guide,command", CASES, ids=[f"{g}:{c}" for g, c in CASES])
def test_guide_command_runs(guide, command, tmp_path):
    argv = shlex.split(command)
    exe = shutil.which("dspark-twin")
    argv = [exe] + argv[1:] if exe else [sys.executable, "-m", "twin.cli"] + argv[1:]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, f"{guide}: `{command}` exited {r.returncode}\n{r.stderr[-2000:]}"
    assert r.stdout.strip()


def test_guides_have_commands():
    assert len(CASES) >= 3
