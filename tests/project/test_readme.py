"""README.md and benchmarks/RESULTS.md point only at things that exist: every relative link (and
its #anchor) resolves, every `make` target and `python -m` module the README names is there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "benchmarks/RESULTS.md")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation but - and _ dropped,
    spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {anchor(m[1]) for m in re.finditer(r"^#+ (.*)$", path.read_text(), re.MULTILINE)}


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_resolves(doc):
    source = ROOT / doc
    links = [link for link in LINK.findall(source.read_text())
             if not link.startswith(("http://", "https://", "mailto:"))]
    assert links
    broken = []
    for link in links:
        target, _, fragment = link.partition("#")
        path = (source.parent / target).resolve() if target else source
        if not path.exists() or (fragment and path.suffix == ".md"
                                 and fragment not in anchors(path)):
            broken.append(link)
    assert broken == []


def test_the_anchor_rule_matches_github():
    assert anchor("Speed against open_clip on CPU") == "speed-against-open_clip-on-cpu"
    assert anchor("The pipeline (`dvc.yaml`)") == "the-pipeline-dvcyaml"


def test_every_make_target_and_module_the_readme_names_exists():
    readme = (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"`make ([\w-]+)", readme)) | set(
        re.findall(r"^make ([\w-]+)", readme, re.MULTILINE))
    assert {"run", "test"} <= targets
    assert [t for t in targets if not re.search(rf"^{t}:", makefile, re.MULTILINE)] == []
    modules = set(re.findall(r"python -m ([\w.]*\w)", readme)) - {"stages"}  # stages.<name>
    assert modules
    missing = [m for m in modules if not (ROOT / m.replace(".", "/")).with_suffix(".py").is_file()
               and not (ROOT / m.replace(".", "/") / "__main__.py").is_file()]
    assert missing == []
