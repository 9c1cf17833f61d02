"""benchmarks/RESULTS.md's tables have one owner each: the result file the benchmark wrote
(benchmarks/record.py), rendered by benchmarks/render_results.py. A hand-edited figure, a result
file no table shows, or a command that names no script fails here."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import record  # noqa: E402 - benchmarks/record.py
import render_results  # noqa: E402 - benchmarks/render_results.py

DOC = ROOT / "benchmarks" / "RESULTS.md"
ENVELOPE = {"command", "commit", "dirty", "started_utc", "finished_utc", "machine", "load_avg"}


def test_results_md_is_what_its_result_files_render():
    assert render_results.main(["--check"]) == 0, "run python benchmarks/render_results.py"


def test_every_result_file_says_what_ran_where_and_under_what_load():
    files = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    assert files, "benchmarks/results/ holds the benchmarks' result files"
    for path in files:
        data = json.loads(path.read_text())
        assert data["benchmark"] == path.stem and "results" in data, path.name
        assert data["meta"].keys() >= ENVELOPE, path.name
        assert {"cpu", "cores", "memory_gb"} <= data["meta"]["machine"].keys(), path.name


def test_every_benchmark_command_in_results_md_names_a_script_that_exists():
    from benchmarks.throughput import SUBCOMMANDS

    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.DOTALL)
    commands = [shlex.split(line.split("#")[0]) for block in blocks
                for line in block.replace("\\\n", " ").splitlines() if line.split("#")[0].strip()]
    assert commands
    for argv in commands:
        for i, arg in enumerate(argv):
            if arg.startswith("benchmarks/") and arg.endswith(".py"):
                assert (ROOT / arg).is_file(), arg
            if arg == "clipms-bench":
                assert argv[i + 1] in SUBCOMMANDS, argv


def test_a_hand_edited_figure_fails_the_check_and_rendering_restores_it(tmp_path):
    results = tmp_path / "results"
    recording = record.Recording("retrieval", "clipms-bench retrieval")
    recording.write([{"images": 50, "captions": 250, "dim": 8, "chunk": 16, "median_s": 0.5,
                      "times_s": [0.5, 0.6], "cpu_s_per_run": 0.4}], results / "retrieval.json")
    doc = tmp_path / "RESULTS.md"
    doc.write_text("# R\n\n<!-- rendered: retrieval -->\nold\n<!-- /rendered -->\n\n"
                   "<!-- rendered: later -->\nkept as it is\n<!-- /rendered -->\n")
    args = ["--doc", str(doc), "--results", str(results)]
    assert render_results.main([*args, "--check"]) == 1  # "old" is not what the file says
    assert render_results.main(args) == 0
    rendered = doc.read_text()
    assert "| 50 | 250 | 8 | 16 | 0.5 | 0.5, 0.6 | 0.4 |" in rendered
    assert "kept as it is" in rendered  # no later.json yet: pending, untouched
    assert render_results.main([*args, "--check"]) == 0
    doc.write_text(rendered.replace("| 0.5 | 0.5, 0.6 |", "| 0.45 | 0.5, 0.6 |"))
    assert render_results.main([*args, "--check"]) == 1


def test_a_docs_page_renders_a_result_and_is_checked_with_results_md(tmp_path):
    """docs/scaling.md shows the search benchmark's figures where its readers look: rendered from
    the same file, checked by the same command."""
    assert ROOT / "docs" / "scaling.md" in render_results.DOCS
    results = tmp_path / "results"
    record.Recording("retrieval", "clipms-bench retrieval").write(
        [{"images": 50, "captions": 250, "dim": 8, "chunk": 16, "median_s": 0.5,
          "times_s": [0.5, 0.6], "cpu_s_per_run": 0.4}], results / "retrieval.json")
    main_doc, page = tmp_path / "RESULTS.md", tmp_path / "scaling.md"
    block = "<!-- rendered: retrieval -->\nold\n<!-- /rendered -->\n"
    main_doc.write_text("# R\n\n" + block)
    page.write_text("# S\n\n" + block)
    args = ["--doc", str(main_doc), "--doc", str(page), "--results", str(results)]
    assert render_results.main([*args, "--check"]) == 1
    assert render_results.main(args) == 0
    for doc in (main_doc, page):
        assert "| 50 | 250 | 8 | 16 | 0.5 | 0.5, 0.6 | 0.4 |" in doc.read_text(), doc.name
    assert render_results.main([*args, "--check"]) == 0
    page.write_text(page.read_text().replace("| 0.5 | 0.5, 0.6 |", "| 0.45 | 0.5, 0.6 |"))
    assert render_results.main([*args, "--check"]) == 1  # a hand edit in the page fails too


def test_a_result_file_no_table_renders_fails_the_check(tmp_path):
    results = tmp_path / "results"
    record.Recording("orphan", "true").write({"x": 1}, results / "orphan.json")
    doc = tmp_path / "RESULTS.md"
    doc.write_text("# R\n")
    assert render_results.main(["--doc", str(doc), "--results", str(results), "--check"]) == 1


def test_a_benchmark_without_a_renderer_gets_a_plain_table(tmp_path):
    results = tmp_path / "results"
    record.Recording("new_bench", "python benchmarks/new.py").write(
        [{"size": 10, "seconds": 1.5}, {"size": 20, "seconds": 3.25}], results / "new_bench.json")
    body = render_results.render_block("new_bench", results)
    assert "`python benchmarks/new.py`" in body
    assert "| size | seconds |" in body and "| 20 | 3.25 |" in body


HAND_MEASURED = """\
_Other modules, measured before the benchmark wrote a result file (by hand, load 1-27)._

| module | file | mutants | killed | survived | no tests | timeout | score |
| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |
| urlguard | `prep/urlguard.py` | 379 | 336 | 39 | 0 | 4 | 89.7% |
| captions | `prep/captions.py` | 724 | 638 | 86 | 0 | 0 | 88.1% |
| gate | `registry/gate.py` (the decision) | 197 | 194 | 3 | 0 | 0 | 98.5% |
"""


def test_the_mutation_block_renders_its_modules_and_keeps_the_earlier_rows_of_the_others(
        tmp_path):
    """A module's row comes from benchmarks/results/mutation.json once a run recorded it (with
    its commit, wall time and load); the rows measured by hand before that file existed stay, under
    their note, for the modules it does not hold yet, and go when it holds them all."""
    results = tmp_path / "results"
    recording = record.Recording("mutation", "python benchmarks/mutation.py urlguard")
    counts = {"file": "prep/urlguard.py", "mutants": 527, "killed": 470, "survived": 50,
              "no tests": 2, "timeout": 5, "other": 0, "wall_min": 21.5,
              "meta": recording.meta()}
    recording.write({"urlguard": counts}, results / "mutation.json")
    doc = tmp_path / "RESULTS.md"
    doc.write_text("## M\n\n<!-- rendered: mutation -->\n" + HAND_MEASURED
                   + "<!-- /rendered -->\n\nprose after\n")
    args = ["--doc", str(doc), "--results", str(results)]
    assert render_results.main([*args, "--check"]) == 1
    assert render_results.main(args) == 0
    rendered = doc.read_text()
    block = rendered.split("<!-- rendered: mutation -->\n")[1].split("<!-- /rendered -->")[0]
    commit, day = counts["meta"]["commit"], counts["meta"]["started_utc"][:10]
    assert block.startswith("_`python benchmarks/mutation.py urlguard` at ")
    load = counts["meta"]["load_avg"]
    assert (f"| urlguard | `prep/urlguard.py` | {commit} | {day} | {load['start'][0]} / "
            f"{load['end'][0]} | 527 | 470 | 50 | 2 | 5 | 90.1% | 21.5 |") in block
    assert "| 379 |" not in block  # the hand row of a recorded module is gone
    earlier = block[block.index("measured before the benchmark wrote a result file"):]
    assert "| captions |" in earlier and "| gate |" in earlier and "urlguard" not in earlier
    assert "(by hand, load 1-27)._" in earlier and "| module | file | mutants |" in earlier
    assert rendered.endswith("<!-- /rendered -->\n\nprose after\n")
    assert render_results.main([*args, "--check"]) == 0  # rendering again changes nothing
    recording.write({"urlguard": counts, "captions": {**counts, "file": "prep/captions.py"},
                     "gate": {**counts, "file": "registry/gate.py"}}, results / "mutation.json")
    assert render_results.main(args) == 0
    block = doc.read_text().split("<!-- rendered: mutation -->\n")[1]
    assert "measured before" not in block and "| 724 |" not in block  # all from the file now
    assert block.count("| 527 | 470 |") == 3


def test_the_record_names_the_commit_the_machine_and_the_load(tmp_path, monkeypatch):
    monkeypatch.setenv(record.NOTE_VARIABLE, "idle: nothing else ran")
    path = record.Recording("x", "clipms-bench loader").write({"a": 1}, tmp_path / "x.json")
    meta = json.loads(path.read_text())["meta"]
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout.strip()
    assert meta["commit"] == head and isinstance(meta["dirty"], bool)
    assert meta["machine"]["cores"] >= 1 and len(meta["load_avg"]["start"]) == 3
    assert meta["note"] == "idle: nothing else ran"


def test_the_machine_names_its_widest_vector_extension():
    # Training differs across vector extensions, so a figure must carry the one it ran on.
    assert record.simd("fpu sse4_2 avx avx2 avx512f avx512bw") == "avx512f"
    assert record.simd("fpu sse4_2 avx avx2") == "avx2"
    assert record.simd("fp asimd evtstrm aes") == "asimd"
    assert record.simd("fpu") is None
    body = render_results.measured({"meta": {
        "command": "c", "commit": "abc1234", "dirty": False, "note": None,
        "machine": {"cpu": "CPU X", "simd": "avx2", "cores": 2, "memory_gb": 8},
        "load_avg": {"start": [1.0, 1, 1], "end": [2.0, 2, 2]},
        "started_utc": "2026-01-02T03:04:05Z", "finished_utc": "2026-01-02T03:05:05Z"}})
    assert "CPU X (avx2), 2 cores" in body and "2026" not in body


def test_commands_are_recorded_as_typed_in_the_repository():
    shown = record.shown_command([sys.executable, str(ROOT / "benchmarks" / "bench_data.py"),
                                  "shard", "--out", str(ROOT / "x.json"), "/elsewhere/y"])
    assert shown == "python benchmarks/bench_data.py shard --out x.json /elsewhere/y"
    assert record.shown_command([str(Path(sys.executable).parent / "clipms-bench"),
                                 "loader"]) == "clipms-bench loader"


def test_alternated_commands_rotate_their_order_each_round():
    def printing(label: str) -> list[str]:
        return [sys.executable, "-c", f"print('not json'); print('{{\"side\": \"{label}\"}}')"]

    runs = record.alternate({"a": printing("a"), "b": printing("b"), "c": printing("c")}, 3)
    order = [[r["label"] for r in runs if r["round"] == n] for n in range(3)]
    assert order == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert all(r["result"] == {"side": r["label"]} for r in runs)


def test_a_failing_benchmark_command_is_an_error_not_an_empty_result():
    with pytest.raises(RuntimeError, match="exited 3"):
        record.json_lines([sys.executable, "-c", "print('{\"x\": 1}'); raise SystemExit(3)"])


def test_a_recording_names_the_commit_it_started_on(tmp_path):
    """A benchmark of an hour ends after the checkout may have moved on: the commit recorded is
    the tree it measured, taken when it started. record.py in a git repository of its own, whose
    HEAD moves on between the start and the write."""
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    source = ROOT / "benchmarks" / "record.py"
    (repo / "benchmarks" / "record.py").write_bytes(source.read_bytes())
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@example.com"]

    def head() -> str:
        return subprocess.run(git + ["rev-parse", "--short=7", "HEAD"], cwd=repo, check=True,
                              capture_output=True, text=True).stdout.strip()

    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "measured"]):
        subprocess.run(git + args, cwd=repo, check=True)
    measured = head()
    benchmark = (
        "import subprocess, sys\n"
        "sys.path.insert(0, 'benchmarks')\n"
        "import record\n"
        "recording = record.Recording('x', 'python benchmarks/x.py')\n"
        f"subprocess.run({git + ['commit', '-q', '--allow-empty', '-m', 'later']!r}, check=True)\n"
        "recording.write({'a': 1}, record.Path('x.json'))\n")
    subprocess.run([sys.executable, "-c", benchmark], cwd=repo, check=True)
    meta = json.loads((repo / "x.json").read_text())["meta"]
    assert meta["commit"] == measured != head()
    assert meta["dirty"] is False
