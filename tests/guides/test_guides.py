"""guides/migration.md: every diff names a runnable script, and every script runs and passes its own assertions."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDES = ROOT / "guides"
MIGRATION = GUIDES / "migration.md"
SCRIPTS = sorted((GUIDES / "examples").glob("migrate_*.py"))
SKIP = 77  # a script that cannot run in this environment exits with 77 and prints "SKIP: <reason>"
SCRIPT_LINE = re.compile(r"^Script: \[`examples/(migrate_\w+\.py)`\]\(examples/\1\)\s*$")


def fenced_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(line index of the opening fence, info string, body lines) for every fenced code block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if m:
            start, body = i, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            assert i < len(lines), f"migration.md: unclosed code block at line {start + 1}"
            blocks.append((start, m.group(1), body))
        i += 1
    return blocks


def script_for(lines: list[str], fence: int) -> str | None:
    """The script named by the last 'Script: ...' line above the fence, within the same '## ' section."""
    for line in reversed(lines[:fence]):
        if line.startswith("## "):
            return None
        m = SCRIPT_LINE.match(line)
        if m:
            return m.group(1)
    return None


def test_every_diff_names_an_existing_script():
    text = MIGRATION.read_text()
    lines = text.splitlines()
    diffs = [(start, body) for start, info, body in fenced_blocks(text) if info == "diff"]
    assert len(diffs) >= 6, "migration.md should hold one diff per migration"
    named = set()
    for start, body in diffs:
        script = script_for(lines, start)
        assert script, f"migration.md line {start + 1}: a diff block without a 'Script: [`examples/...`]' line above"
        assert (GUIDES / "examples" / script).is_file(), f"migration.md line {start + 1}: {script} does not exist"
        named.add(script)
        changed = [line for line in body if line[:1] in "+-"]
        assert changed, f"migration.md line {start + 1}: a diff with no + or - line"
        assert all(line[:1] in "+- " or line == "" for line in body), \
            f"migration.md line {start + 1}: diff lines must start with '+', '-' or a space"
    assert named == {p.name for p in SCRIPTS}, "every migrate_*.py is backed by a diff, and the other way round"


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
@pytest.mark.examples
def test_migration_script_runs(script: Path, tmp_path: Path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=240)
    if proc.returncode == SKIP:
        reasons = [line for line in proc.stdout.splitlines() if line.startswith("SKIP:")]
        pytest.skip(reasons[-1][len("SKIP:"):].strip() if reasons else f"{script.name} cannot run here")
    output = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"{script.name} exited with {proc.returncode}:\n{output}"
    # Each script prints a line "OK" once all its assertions held (DeepSpeed, imported by ORT, may log after it).
    assert "OK" in proc.stdout.splitlines(), output
