"""Every command a guide shows works as written (a new user follows only the page).

From each guide's ```bash blocks: every `dspark-twin` command runs, in a scratch directory, with the
files the block creates first (`cat > NAME <<'EOF'` heredocs); it must exit with status 0, or with
the status its comment names (`# exit status 1: ...`). The ```python blocks of PYTHON_GUIDES run too,
in order, in the same scratch directory after the page's commands.
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# guides whose commands are cheap enough to run in the suite (the slowest, about 20 s, are simulator runs)
GUIDES = ["README.md", "docs/capacity.md", "docs/simulation.md", "docs/lockstep.md", "docs/calibration.md"]
# guides whose ```python blocks are self-contained and cheap (simulation.md's runs 512 requests and
# lockstep.md's PyPTO block needs a runtime: both were tried by hand)
PYTHON_GUIDES = ["docs/calibration.md", "docs/capacity.md", "docs/lowering.md", "docs/torch-device.md"]
HEREDOC = re.compile(r"^cat > (\S+) <<'?(\w+)'?$")
EXIT = re.compile(r"exit status (\d+)")


def guide_commands(name):
    return parse_commands((ROOT / name).read_text())


def parse_commands(text):
    """(command, expected exit status, {file: text} created by the page before it)."""
    files = {}
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        lines = iter(block.splitlines())
        for raw in lines:
            m = HEREDOC.match(raw.strip())
            if m:
                body = []
                for more in lines:
                    if more.strip() == m.group(2):
                        break
                    body.append(more)
                files[m.group(1)] = "\n".join(body) + "\n"
                continue
            line, _, comment = raw.partition("#")
            status = EXIT.search(comment)
            for part in line.split("&&"):
                part = part.strip()
                if part.startswith("dspark-twin"):
                    yield part, int(status.group(1)) if status else 0, dict(files)


def run_command(command, cwd):
    argv = shlex.split(command)
    exe = shutil.which("dspark-twin")
    argv = [exe] + argv[1:] if exe else [sys.executable, "-m", "twin.cli"] + argv[1:]
    # env: the child gets a copy of the environment made in this thread.  Without it, CPython's
    # vfork'ed child execs with the process's live `environ` while the main thread goes on running
    # tests, and pytest sets PYTEST_CURRENT_TEST at every phase of every test: that putenv can
    # move or free the array the child is reading, and exec fails with EFAULT ("OSError: [Errno 14]
    # Bad address")
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=cwd, env=dict(os.environ))


def _cases():
    """Distinct (command, status, files), each with the guides that show it (README and a guide may share one)."""
    seen = {}
    for g in GUIDES:
        for c, s, f in guide_commands(g):
            seen.setdefault((c, s, tuple(sorted(f.items()))), []).append(g)
    return [(guides, c, s, dict(f)) for (c, s, f), guides in seen.items()]


CASES = _cases()
# one worker runs every test of this module: `launched` starts the commands of every selected test,
# and under xdist each worker's session holds every test collected, so a second worker would run
# every command again (pyproject.toml's addopts: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("guides")
# the commands are independent simulator and lockstep runs, one core each: run them side by side
WORKERS = min(4, os.cpu_count() or 2)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """Start every selected command at once (WORKERS at a time), each guide in its own scratch
    directory holding the files its page creates; a test then waits for its own command."""
    selected = {it.callspec.params["command"] for it in request.session.items
                if getattr(it, "originalname", "") == "test_guide_command_runs" and hasattr(it, "callspec")}
    selected |= {c for g in PYTHON_GUIDES for c, _, _ in guide_commands(g)
                 if any(getattr(it, "originalname", "") == "test_guide_python_runs" for it in request.session.items)}
    dirs, futures = {}, {}
    with ThreadPoolExecutor(WORKERS) as pool:
        for guides, command, _, files in CASES:
            if command not in selected:
                continue
            for g in guides:
                if g not in dirs:
                    dirs[g] = tmp_path_factory.mktemp(Path(g).stem)
                for fname, text in files.items():
                    (dirs[g] / fname).write_text(text)
            futures[command] = pool.submit(run_command, command, dirs[guides[0]])
        yield dirs, futures


@pytest.mark.parametrize("guides,command,status,files", CASES, ids=[f"{g[0]}:{c}" for g, c, _, _ in CASES])
def test_guide_command_runs(guides, command, status, files, launched):
    r = launched[1][command].result()
    assert r.returncode == status, f"{guides}: `{command}` exited {r.returncode}, expected {status}\n{r.stderr[-2000:]}"
    assert r.stdout.strip()


@pytest.mark.parametrize("guide", PYTHON_GUIDES)
def test_guide_python_runs(guide, launched, tmp_path):
    """The page's Python blocks in order, where its commands ran (they read what the commands wrote)."""
    dirs, futures = launched
    cwd = dirs.get(guide, tmp_path)
    for command, status, _ in guide_commands(guide):
        assert futures[command].result().returncode == status, command
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", (ROOT / guide).read_text(), flags=re.S)):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd)
        assert r.returncode == 0, f"{guide}: python block {i} failed\n{r.stderr[-3000:]}"


def test_parse_reads_heredocs_exit_status_and_chains():
    page = ("text\n```bash\npip install -e . && dspark-twin a\ncat > p.json <<'EOF'\n{\"k\": 1}\n# not a comment\nEOF\n"
            "dspark-twin b --p p.json   # exit status 3: nothing fits\n```\n```python\ndspark-twin c\n```\n")
    got = list(parse_commands(page))
    assert got == [("dspark-twin a", 0, {}), ("dspark-twin b --p p.json", 3, {"p.json": '{"k": 1}\n# not a comment\n'})]


def test_guides_have_commands():
    for g in GUIDES:
        assert any(True for _ in guide_commands(g)), f"{g} shows no dspark-twin command"
    assert len(CASES) >= 12
