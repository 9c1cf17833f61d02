"""Notes in the code stay true and stay inside the repository.

- A measured figure (a speed, a ratio, "measured ... 84 steps") in a module that a DVC stage depends
  on would make `dvc repro` rerun that stage whenever a benchmark is refreshed: such figures live in
  docs/ and benchmarks/RESULTS.md, and the code points there.
- Nothing in the repository points to `../shared/...`: a clone does not have it.
- The repository speaks to its users, not to the team that wrote it: no tracker reference ("issue
  14.10"), no "the lead", no numbered rounds or sessions of work, no path of a development
  machine. A reader has none of these; each such note states its reason instead.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]

# A number next to a unit of speed or a ratio, or "measured" followed by a number in the same
# clause. Letters glued to a digit (fp16, R@5's "5" after "@" is fine too) are not figures.
MEASURED_FIGURE = re.compile(
    r"measured[^.;\n]{0,60}(?<![A-Za-z@])\d"
    r"|~\d[\d.]*\s*(x|s|ms|%)(?!\w)"
    r"|(?<![A-Za-z])\d[\d.]*x (the cost|faster|slower|smaller|larger)"
    r"|\d[\d.,]*\s*(samples/s|images/s|texts/s|it/s|ms/step|s/step|MB/s|QPS|req/s)"
    r"|took ~?\d",
    re.IGNORECASE,
)
OUTSIDE_POINTER = re.compile(r"\.\./shared|stack-notes|shared/design\.md")
TEAM_HISTORY = re.compile(
    r"\bissues? #?\d"
    r"|\bthe lead\b|\bthe lead's\b"
    r"|\b(first|second|third|fourth|fifth|sixth|seventh|eighth) rounds?\b"
    r"|\b(\d+|two|three|four|five|six|seven|eight|other|several|another|second|previous|earlier)"
    r" sessions?\b(?! (fixture|scope))"
    r"|(?<![\w.])/work/",
    re.IGNORECASE,
)


def tracked_modules(dvc_yaml: Path = ROOT / "dvc.yaml") -> list[str]:
    """Every Python file some stage of dvc.yaml depends on."""
    stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
    return sorted({d for s in stages.values() for d in s.get("deps", []) if str(d).endswith(".py")})


def figures_in(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if MEASURED_FIGURE.search(line)]


def test_the_rule_sees_figures_and_leaves_plain_numbers_alone():
    assert figures_in("# pandas took ~15 s on 600k captions here")
    assert figures_in("# the same result at ~6x the cost")
    assert figures_in("(measured: shape began to be learned within 84 steps)")
    assert figures_in("loader: 250 samples/s per core")
    assert not figures_in("an fp16 export; the measured errors are in docs/ascend.md")
    assert not figures_in("i2t R@5 on 2 shards, batch 64, lr 5e-4")


def test_no_measured_figure_in_a_module_a_stage_depends_on():
    modules = tracked_modules()
    assert "clipms/train/loop.py" in modules and "stages/train.py" in modules  # the list is real
    found = {m: figures_in((ROOT / m).read_text()) for m in modules}
    assert {m: lines for m, lines in found.items() if lines} == {}, (
        "move measured figures to docs/ or benchmarks/RESULTS.md and point there")


def test_nothing_in_the_repository_points_outside_it():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    assert "README.md" in files
    here = Path(__file__).resolve().relative_to(ROOT).as_posix()
    hits = [f"{name}:{n}" for name in files if name != here and (ROOT / name).is_file()
            and not name.endswith((".png", ".tar", ".parquet", ".ckpt", ".mindir"))
            for n, line in enumerate(_lines(ROOT / name), 1) if OUTSIDE_POINTER.search(line)]
    assert hits == []


def test_the_history_rule_sees_team_notes_and_leaves_technical_words_alone():
    for note in ("(issue 14.10)", "Issue 13's targets", "the lead's figure", "fifth round",
                 "eight sessions shared the cores", "/work/peer-venv/bin/python"):
        assert TEAM_HISTORY.search(note), note
    for text in ("start_new_session=True", "a session fixture", "2 rounds of 5 s per cell",
                 "rounded half up", "the round in hand", "~/venvs/openclip/bin/python",
                 "github.com/org/repo/issues/12"):
        assert not TEAM_HISTORY.search(text), text


def test_no_team_history_or_development_machine_path_in_the_repository():
    here = Path(__file__).resolve().relative_to(ROOT).as_posix()
    hits = [f"{name}:{n}: {line.strip()}" for name in _tracked_text_files()
            if name != here
            for n, line in enumerate(_lines(ROOT / name), 1) if TEAM_HISTORY.search(line)]
    assert hits == [], "state the reason itself, not who did what when (see the module docstring)"


def _tracked_text_files() -> list[str]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    assert "README.md" in files
    return [name for name in files if (ROOT / name).is_file()
            and not name.endswith((".png", ".tar", ".parquet", ".ckpt", ".mindir"))]


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except UnicodeDecodeError:
        return []
