"""Render benchmarks/RESULTS.md's tables (and docs/scaling.md's) from the result files the
benchmarks write.

    python benchmarks/render_results.py           # rewrite the tables from benchmarks/results/
    python benchmarks/render_results.py --check   # exit 1 if a table and its file disagree

In RESULTS.md (and the docs pages in DOCS) a table is the text between
`<!-- rendered: NAME -->` and `<!-- /rendered -->`; it is rendered from
benchmarks/results/NAME.json (benchmarks/record.py's envelope) by the function RENDERERS names
for NAME, or as a plain table of the results when there is none. So each figure has one owner,
the file the benchmark wrote; the prose around a table says what it measures and how to read
it. A block whose file does not exist yet is left as it is and listed as pending: its figures
predate the result files, and its section names the command that replaces them. The mutation
block is both: a row per module its file holds, then, under their own note, the rows measured by
hand before the file existed for the modules it does not hold yet (EARLIER).
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "benchmarks" / "RESULTS.md"
# Every document with rendered blocks: RESULTS.md holds a section per benchmark; a docs page may
# render a result again where its readers need the figures (docs/scaling.md: search at size).
DOCS = (DOC, ROOT / "docs" / "scaling.md")
RESULTS = ROOT / "benchmarks" / "results"
BLOCK = re.compile(r"(<!-- rendered: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /rendered -->)",
                   re.DOTALL)

Record = dict[str, Any]


# ---- shared pieces ---------------------------------------------------------------------------


def table(header: list[str], rows: list[list[Any]], right: int = 0) -> str:
    """A markdown table; the last `right` columns aligned right (numbers)."""
    align = ["---"] * (len(header) - right) + ["---:"] * right
    lines = [header, align, *[[cell(v) for v in row] for row in rows]]
    return "\n".join("| " + " | ".join(str(v) for v in line) + " |" for line in lines) + "\n"


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def measured(record: Record) -> str:
    """The line above every table: command, commit, machine, load, note. No date: the commit
    says when, and the result file keeps the times (`meta.started_utc`)."""
    meta = record["meta"]
    m = meta["machine"]
    commit = meta["commit"] or "unknown commit"
    if meta.get("dirty"):
        commit += " (with uncommitted changes)"
    load = meta["load_avg"]
    cpu = f"{m['cpu']} ({m['simd']})" if m.get("simd") else m["cpu"]
    line = (f"_`{meta['command']}` at {commit}; {cpu}, {m['cores']} cores, "
            f"{m['memory_gb']} GB; 1-minute load {load['start'][0]} at the start, "
            f"{load['end'][0]} at the end")
    if meta.get("note"):
        line += f" ({meta['note'].rstrip('.')})"
    return line + "._\n\n"


def plain(record: Record) -> str:
    """Any result: a list of flat objects as rows, an object as key/value rows."""
    results = record["results"]
    rows = results if isinstance(results, list) else [results]
    keys = list(dict.fromkeys(k for row in rows for k in row))
    return table(keys, [[json.dumps(row[k]) if isinstance(row.get(k), dict | list) else row.get(k)
                         for k in keys] for row in rows])


# ---- one renderer per benchmark that needs more than a plain table ---------------------------


def speed_vs_openclip(record: Record) -> str:
    res, out = record["results"], []
    batch = res["batch_size"]
    for work, unit, cpu in (("train", "samples_per_s", "cpu_step_ms"),
                            ("encode", "images_per_s", "image"), ("encode", "texts_per_s", "text")):
        for rnd in sorted({r["round"] for r in res["runs"].get(work, [])}):
            runs = {r["label"]: r["result"] for r in res["runs"][work] if r["round"] == rnd}
            ours, peer = runs["clipms"][unit], runs["open_clip"][unit]
            out.append([f"{work} ({unit.replace('_per_s', '/s')})", rnd + 1, ours,
                        runs["clipms_unfused"][unit], peer, f"{ours / peer:.2f}x",
                        f"{_cpu_ms(runs['clipms'], cpu, batch):.2f} / "
                        f"{_cpu_ms(runs['open_clip'], cpu, batch):.2f}"])
    return table(["work", "round", "clipms", "clipms, fusion off", "open_clip",
                  "clipms / open_clip", "CPU ms per item, clipms / open_clip"], out, right=5)


def _cpu_ms(result: dict[str, Any], kind: str, batch: int) -> float:
    if kind == "cpu_step_ms":
        return result["cpu_step_ms"] / batch
    return result.get(f"cpu_ms_per_{kind}") or result[f"cpu_{kind}_step_ms"] / batch


def loader(record: Record) -> str:
    rows = [[i + 1, r["workers"], r["image_size"], r["samples_per_s"],
             r.get("cpu_ms_per_sample"), r["load_avg_1m"][0], r["load_avg_1m"][1]]
            for i, r in enumerate(record["results"])]
    return table(["run", "workers", "image px", "samples/s", "CPU ms per sample",
                  "load at start", "load at end"], rows, right=7)


def retrieval(record: Record) -> str:
    rows = [[r["images"], r["captions"], r["dim"], r["chunk"], r["median_s"],
             ", ".join(f"{t:g}" for t in r["times_s"]), r["cpu_s_per_run"]]
            for r in record["results"]]
    return table(["images", "captions", "dim", "chunk", "median s", "runs, s", "CPU s per run"],
                 rows, right=7)


def data_dedupe(record: Record) -> str:
    r = record["results"]
    return table(["rows in", "images out", "wall s", "CPU s", "removed"],
                 [[r["rows_in"], r["images_out"], r["seconds"], r["cpu_seconds"],
                   ", ".join(f"{k} {v:,}" for k, v in r["removed"].items())]], right=4)


def data_shard(record: Record) -> str:
    r = record["results"]
    return table(["samples", "workers", "wall s", "samples/s", "CPU s", "samples per CPU-s"],
                 [[r["samples"], r["workers"], r["seconds"], r["samples_per_s"],
                   r["cpu_seconds"], r["samples_per_cpu_s"]]], right=6)


def data_download(record: Record) -> str:
    r = record["results"]
    return table(["images", "fetched", "distributor", "processes x threads", "wall s",
                  "images/s", "CPU s (server included)"],
                 [[r["images"], r["successes"], r["distributor"],
                   f"{r['processes']} x {r['threads']}", r["seconds"], r["images_per_s"],
                   r["cpu_seconds_incl_server"]]], right=3)


def data_urlguard(record: Record) -> str:
    r = record["results"]
    rates = r["requests_per_s"]
    return table(["requests per round", "rounds", "urllib, req/s", "guarded, req/s",
                  "guarded / urllib"],
                 [[r["requests_per_round"], r["rounds"], rates["urllib"], rates["guarded"],
                   r["guarded_over_urllib"]]], right=5)


def checkpoint(record: Record) -> str:
    r = record["results"]
    return table(["preset", "parameters", "file MB", "sync save s", "async: training blocked s",
                  "async: written s"],
                 [[r["preset"], r["parameters"], r["file_mb"], r["sync_save_s"],
                   r["async_blocked_s"], r["async_written_s"]]], right=5)


def export_fp16_parity(record: Record) -> str:
    rows = []
    for r in record["results"]:
        for tower in ("image", "text"):
            errors = {k: v for k, v in r.items() if k.startswith(tower)}
            rows.append([r["preset"], r["precision"], tower,
                         _first(errors, "normalized"), _first(errors, "_error", "normalized"),
                         r["mb"].get(f"{tower}_encoder.mindir"), r["passed"]])
    return table(["preset", "precision", "tower", "max abs error, normalised", "raw",
                  "MindIR MB", "parity passed"], rows, right=4)


def _first(values: dict[str, Any], has: str, lacks: str = "\0") -> Any:
    return next((v for k, v in values.items() if has in k and lacks not in k), None)


def mutation(record: Record) -> str:
    """One row per module the file holds, each with its own run's commit, day, wall time and
    load (benchmarks/mutation.py records the modules it ran and keeps the others' last entry)."""
    rows = []
    for label, m in record["results"].items():
        score = (m["killed"] + m["timeout"]) / m["mutants"] if m["mutants"] else None
        load = m["meta"]["load_avg"]
        rows.append([label, f"`{m['file']}`", m["meta"]["commit"], m["meta"]["started_utc"][:10],
                     f"{load['start'][0]} / {load['end'][0]}", m["mutants"], m["killed"],
                     m["survived"], m["no tests"], m["timeout"],
                     f"{score:.1%}" if score is not None else "-", m.get("wall_min")])
    return table(["module", "file", "commit", "run", "load, start / end", "mutants", "killed",
                  "survived", "no tests", "timeout", "score", "wall min"], rows, right=7)


# The note over the mutation rows measured by hand before benchmarks/mutation.py wrote a result
# file; those rows stay in the block, under it, until a run records their module.
MEASURED_BEFORE = "measured before the benchmark wrote a result file"


def mutation_earlier(record: Record, previous: str) -> str:
    """The hand-measured rows of `previous` (the block as it was) for the modules the result file
    does not hold, under their note as written; "" when the file holds them all. Nothing is
    invented: a module leaves this table only for its row from the file."""
    at = previous.lower().find(MEASURED_BEFORE)
    if at < 0:
        return ""
    start = previous.rfind("\n", 0, at) + 1
    note, _, rest = previous[start:].partition("\n\n")
    lines = [line for line in rest.splitlines() if line.startswith("|")]
    kept = [line for line in lines[2:] if line.split("|")[1].strip() not in record["results"]]
    if not kept:
        return ""
    return "\n" + note + "\n\n" + "\n".join(lines[:2] + kept) + "\n"


def mutation_tiers(record: Record) -> str:
    """Per module: the fast tier's kills beside the whole suite's, and what only slow tests kill."""
    rows = []
    for label, m in record["results"].items():
        fast, every = m["fast"], m["all"]
        rows.append([label, f"`{m['file']}`", fast["mutants"], fast["killed"], every["killed"],
                     fast["wall_min"], every["wall_min"],
                     ", ".join(m["killed_only_with_slow_tests"]) or "none"])
    return table(["module", "file", "mutants", "killed by the fast tier", "killed by all tests",
                  "fast tier min", "all tests min", "killed only by slow tests"], rows, right=5)


def serving(record: Record) -> str:
    """The goals per mode, then every workload's medians (QPS, p99 ms)."""
    res = record["results"]
    goals = []
    for mode, s in res["summary"].items():
        goals.append([mode, f"{s['vs_mlflow']}x" if s.get("vs_mlflow") else "-",
                      f"{s['vs_batching_off']}x" if s.get("vs_batching_off") else "-",
                      f"{s['vs_model_limit']} (pairs "
                      f"{', '.join(map(str, s['vs_model_limit_pairs']))})",
                      s.get("p99_ms_c8_text"), s.get("errors")])
    text = table(["mode (concurrency 32, text embeddings)", "vs `mlflow models serve` (>= 3x)",
                  "vs batching off (>= 2x)", "vs the model alone (>= 0.7)",
                  "p99 ms at concurrency 8 (< 150)", "errors"], goals, right=2)
    return text + "\n" + serving_cells(res["cells"])


def serving_cells(cells: list[dict[str, Any]]) -> str:
    levels = sorted({c["concurrency"] for c in cells})
    groups: dict[tuple[str, str, str], dict[int, list[dict[str, Any]]]] = {}
    for c in cells:
        groups.setdefault((c["workload"], c["target"], c["mode"]), {}).setdefault(
            c["concurrency"], []).append(c)
    rows = []
    for (work, target, mode), by_level in groups.items():
        rows.append([work, target, mode, *[
            f"{median(c['qps'] for c in by_level[n]):,.0f} "
            f"({median(c['p99_ms'] for c in by_level[n]):.0f})" if n in by_level else "-"
            for n in levels]])
    return table(["workload", "server", "mode", *[f"c={n}, QPS (p99 ms)" for n in levels]],
                 rows, right=len(levels))


def default_run(record: Record) -> str:
    """One column per training seed: `make run` (seed 0), then `dvc exp run -S train.seed=1`."""
    runs = record["results"]
    seeds = [s for s in ("seed0", "seed1") if s in runs]
    rows = [["wall s (`make run`; seed 1: `dvc exp run`)", *[runs[s]["wall_s"] for s in seeds]],
            ["CPU s, user + system", *[round(runs[s]["cpu_user_s"] + runs[s]["cpu_sys_s"])
                                       for s in seeds]],
            ["training wall s", *[runs[s]["train"]["wall_time_s"] for s in seeds]],
            ["training steps", *[runs[s]["train"]["steps"] for s in seeds]],
            ["training samples/s", *[runs[s]["train"]["samples_per_s"] for s in seeds]],
            *[[f"`{k}`", *[runs[s]["eval"][k] for s in seeds]] for k in runs["seed0"]["eval"]]]
    return table(["figure", *[f"train.seed {s[-1]}" for s in seeds]], rows, right=len(seeds))


def time_to_quality(record: Record) -> str:
    """The benchmark's own tables (benchmarks/time_to_quality.py `table`): one owner of their
    layout for the terminal and this document."""
    import time_to_quality as ttq  # benchmarks/time_to_quality.py, beside this file

    return "\n".join(ttq.tables(record["results"])) + "\n"


def quality_vs_openclip(record: Record) -> str:
    """The benchmark's own tables (benchmarks/quality_vs_openclip.py `table`), from its runs."""
    import quality_vs_openclip as qvo  # benchmarks/quality_vs_openclip.py, beside this file

    return "\n".join(qvo.tables(record["results"]["runs"])).strip("\n") + "\n"


def kill_recovery(record: Record) -> str:
    """Each planned kill: where it landed and what it left; then the checks after the last
    `dvc repro`, against the uninterrupted reference."""
    res = record["results"]
    rows = [_kill_row(n, kill) for n, kill in enumerate(res["kills"], 1)]
    text = table(["#", "planned: stage + s", "landed: stage + s", "exit", "stages to rerun",
                  "MLflow runs", "registry versions (aliased)", "rwlock holders (alive)",
                  "temp files", "files in models/checkpoints"], rows,
                 right=7)
    checks, final = res["checks"], res["final"]
    others = sorted(k for keys in checks["other_metrics_differing_keys"].values() for k in keys)
    facts = [
        ["uninterrupted reference `dvc repro`, s", res["reference"]["seconds"]],
        ["last `dvc repro` after the kills: exit, s, stages it ran",
         f"{final['exit']}, {cell(final['seconds'])}, {', '.join(final['stages_run']) or 'none'}"],
        ["`metrics/eval.json` equal to the reference's",
         f"{cell(checks['eval_json_equal'])} ({checks['eval_json_keys']} keys)"],
        ["other metrics' keys that differ", ", ".join(sorted(set(others))) or "none"],
        ["`dvc status` after", "clean" if checks["dvc_status"] == {} else
         ", ".join(sorted(checks["dvc_status"]))],
        ["writers' temp files left", len(checks["temp_files"])],
        ["MLflow runs by status (reference)", f"{_runs(checks['mlflow_runs'])} "
                                              f"({_runs(checks['reference_mlflow_runs'])})"],
        ["every alias on a complete version", checks["aliases_on_complete_versions"]],
        ["all checks passed", res["passed"]],
    ]
    return text + "\n" + table(["after the kills", "value"], facts)


def _kill_row(n: int, kill: dict[str, Any]) -> list[Any]:
    planned = f"{kill['planned']['stage']} +{kill['planned']['after_s']:.1f}"
    if kill.get("skipped"):
        return [n, planned, f"skipped: stage {kill['skipped']}", *["-"] * 7]
    if not kill.get("killed_in"):
        return [n, planned, "finished first", kill["exit"], *["-"] * 6]
    left = kill["left_behind"]
    lock = left.get("dvc_rwlock")
    versions = left.get("registry", [])
    return [n, planned, f"{kill['killed_in']} +{kill['killed_after_s']:.1f}", kill["exit"],
            len(left["stages_to_rerun"]), _runs(left["mlflow_runs"]) or "none",
            f"{len(versions)} ({sum(bool(v['aliases']) for v in versions)})",
            f"{lock['holders']} ({lock['holders_alive']})" if lock else "-",
            len(left["temp_files"]), len(left["checkpoints"])]


def _runs(counts: dict[str, int]) -> str:
    return ", ".join(f"{status} {n}" for status, n in sorted(counts.items()))


def rehearsal(record: Record) -> str:
    """One size of the MSCOCO rehearsal (benchmarks/rehearsal.py): for a run finished with
    `--resume`, each earlier part; a row per stage, the stage's own command and the whole `dvc
    repro` of it; then the stages that did not run."""
    res, rows = record["results"], []
    parts = "".join(f"Earlier part: {measured({'meta': part}).strip()} Its stages: "
                    f"{', '.join(part['stages'])}.\n\n" for part in res.get("earlier_parts", []))
    for s in res["stages"]:
        own, whole = s["command"], s["dvc_repro"]
        rows.append([f"`{s['stage']}`", s.get("unit", "-"), s.get("items"),
                     f"{own.get('wall_s', 0):,.1f} / {whole['wall_s']:,.1f}", own.get("cpu_s"),
                     s.get("cpu_ms_per_item"), s.get("items_per_s"),
                     f"{own.get('peak_rss_mb', 0):,.0f} / {whole['peak_tree_rss_mb']:,.0f}",
                     whole["written_mb"], s["outputs_mb"], whole["exit_code"]])
    text = table(["stage", "unit", "items", "wall s (stage / dvc repro)", "CPU s",
                  "CPU ms per item", "items/s", "peak RSS MB (largest / tree)", "written MB",
                  "outputs MB", "exit"], rows, right=9)
    text = parts + text
    if res.get("not_run"):
        text += f"\nNot run at this size: {', '.join(res['not_run'])}.\n"
    return text


def search_at_size(record: Record) -> str:
    """benchmarks/rehearsal_search.py: each kind's build, recall and search time alone, then
    /v1/search under load (medians over rounds: QPS and p50/p99 ms)."""
    res = record["results"]
    build = res["build"]
    rows = []
    for row in res["search_alone"]:
        if row["kind"] != "exact" and not row.get("default"):
            continue
        kind, cost = row["kind"], build.get(row["kind"], {})
        # sampled, the build's own process: ru_maxrss of a child starts at its parent's
        rows.append([kind, cost.get("wall_s"), cost.get("peak_tree_rss_mb"),
                     cost.get("faiss_index_mb"), res["server_rss_mb_idle"].get(kind),
                     row["text"]["recall@10"], row["text"]["tie_aware_recall@10"],
                     row["image"]["recall@10"], row["text"]["p50_ms"], row["text"]["p99_ms"]])
    text = table(["kind (default settings)", "build s", "build peak RSS MB (sampled)",
                  "FAISS index MB",
                  "service RSS MB, idle", "recall@10, text", "tie-aware, text",
                  "recall@10, image", "search p50 ms", "search p99 ms"], rows, right=9)
    sweep = [[r["kind"], r.get("hnsw_ef_search", r.get("ivf_nprobe")),
              r["text"]["recall@10"], r["image"]["recall@10"], r["text"]["p50_ms"]]
             for r in res["search_alone"] if r["kind"] != "exact"]
    text += "\n" + table(["kind", "ef_search / nprobe", "recall@10, text", "recall@10, image",
                          "search p50 ms"], sweep, right=4)
    return text + "\n" + _search_cells(res["summary"])


def _search_cells(summary: dict[str, dict[str, float]]) -> str:
    levels = sorted({int(key.rsplit("/c", 1)[1]) for key in summary})
    groups: dict[str, dict[int, dict[str, float]]] = {}
    for key, cell in summary.items():
        name, level = key.rsplit("/c", 1)
        groups.setdefault(name, {})[int(level)] = cell
    rows = [[name.split("/")[1], name.split("/")[0], *[
        f"{by[n]['qps']:,.0f} ({by[n]['p50_ms']:.0f} / {by[n]['p99_ms']:.0f})" if n in by
        else "-" for n in levels]] for name, by in sorted(groups.items(), key=lambda g: (
            g[0].split("/")[1], g[0]))]
    return table(["workload", "kind", *[f"c={n}, QPS (p50 / p99 ms)" for n in levels]], rows,
                 right=len(levels))


def incremental_download(record: Record) -> str:
    """The medians side by side with their ratio, then every run in the order it ran."""
    res = record["results"]
    summ = res["summary"]

    def ratio(full: float, incremental: float) -> str:
        return f"{incremental / full:.3f}"

    rows = []
    for label, key, per_round in (("download + shard, wall s", "total_s", "ratio_per_round"),
                                  ("download + shard, CPU s", "total_cpu_s",
                                   "cpu_ratio_per_round"),
                                  ("download, wall s", "download_s", None),
                                  ("shard, wall s", "shard_s", None)):
        full = summ[f"full_{key}_median"]
        night = summ[f"incremental_{key}_median"]
        rounds = ", ".join(f"{r:.3f}" for r in summ[per_round]) if per_round else "-"
        rows.append([label, full, night, ratio(full, night), rounds])
    medians = table(["median of the rounds", f"full run ({summ['grown_images']:,} images)",
                     f"night ({summ['grown_images'] - summ['base_images']:,} new)",
                     "night / full", "per round"], rows, right=4)
    runs = [[r["round"] + 1, r["kind"], r["fetched"], r["reused"], r["samples"],
             r["download_s"], r["shard_s"], r["download_cpu_s"], r["shard_cpu_s"],
             f"{r['load_before']} / {r['load_after']}"] for r in res["runs"]]
    every = table(["round", "run", "fetched", "reused", "samples in the shards", "download s",
                   "shard s", "download CPU s", "shard CPU s", "1-min load before / after"],
                  runs, right=8)
    return medians + "\n" + every


def storage_growth(record: Record) -> str:
    """Per night: the new image bytes, each store's net growth (after retention) and what
    retention freed from it, against the bound; then each store's size, what `retain` kept, and
    the last night's written and freed files by what they are."""
    kb = 1024
    stores = ("dvc_cache", "dvc_remote", "mlflow_artifacts")
    nights_ = record["results"]["nights"]

    def grew(night: dict[str, Any], store: str) -> str:
        within = "" if night[f"{store}_within_bound"] else " (over)"
        freed = night.get(f"{store}_freed")
        net = f"{night[f'{store}_added'] / kb:+,.0f}{within}"
        return net if freed is None else f"{net} ({freed / kb:,.0f})"

    rows = [[n["night"], n["images"], n["new_images"], f"{n['new_image_bytes'] / kb:,.1f}",
             *(grew(n, store) for store in stores),
             f"{n['model_files_bytes'] / kb:,.0f}", f"{n['bound_bytes'] / kb:,.0f}"]
            for n in nights_]
    growth = table(["night", "images", "new", "new image KiB",
                    "DVC cache net KiB (freed)", "DVC remote net KiB (freed)",
                    "MLflow artifacts net KiB (freed)", "model files KiB",
                    "bound KiB (2 x new + model)"], rows, right=8)

    def kept(n: dict[str, Any]) -> str:
        retain = n.get("retain") or {}
        return ", ".join(retain.get("kept", [])) or "-"

    rows = [[n["night"], *(f"{n['totals'].get(store, 0) / kb:,.0f}" for store in stores),
             kept(n), f"{n['shards_kept']} / {n['shards_new']}",
             "-" if n["index_added_bytes"] is None else
             f"{n['index_added_bytes'] / kb:,.0f} / {n['index_bytes'] / kb:,.0f}", n["repro_s"]]
            for n in nights_]
    sizes = table(["night", "DVC cache KiB", "DVC remote KiB", "MLflow artifacts KiB",
                   "versions kept whole", "shards kept / new", "index uploaded / size KiB",
                   "dvc repro s"], rows, right=7)
    out = growth + "\nEach store's size after the night, and what retention kept:\n\n" + sizes
    last = nights_[-1]
    parts = [(what, last.get(key)) for what, key in (
        ("What night {n} wrote to each store", "added_by_kind"),
        ("What left each store on night {n} (retention)", "freed_by_kind")) if last.get(key)]
    for what, kinds in parts:
        names = list(dict.fromkeys(k for store in stores for k in kinds.get(store, {})))
        split = [[name, *(f"{kinds.get(store, {}).get(name, 0) / kb:,.0f}" for store in stores)]
                 for name in names]
        out += (f"\n{what.format(n=last['night'])}, by what it is (KiB):\n\n"
                + table(["what", "DVC cache", "DVC remote", "MLflow artifacts"], split, right=3))
    return out


WARM_METRICS = ("i2t_R@1", "i2t_R@5", "t2i_R@5", "zeroshot_top1")


def warm_start(record: Record) -> str:
    """Per seed: day 1's champion, then each day-2 variant scored on day 2's val split."""
    res, rows = record["results"], []
    for seed, variants in res["seeds"].items():
        for name, run in variants.items():
            what = {"day1": "day 1: cold, the first champion", "kept": "day 2: the champion, "
                    "not trained again", "cold": "day 2: cold (tokenizer and weights new)"}.get(
                name, f"day 2: warm from the champion, {name.removeprefix('warm-')} steps")
            evaluated = run["eval"]
            load = run.get("load_1min")
            rows.append([seed, what, run.get("steps"), run.get("train_wall_time_s"),
                         run.get("train_stage_s"), run.get("samples_per_s"),
                         f"{load[0]} / {load[1]}" if load else None,
                         *[evaluated.get(k) for k in WARM_METRICS], evaluated.get("num_images")])
    return table(["train.seed", "model", "steps", "training wall s", "train stage s",
                  "samples/s", "1-min load before / after", *[f"`{k}`" for k in WARM_METRICS],
                  "val images"], rows, right=10)


def nights(record: Record) -> str:
    """Per night: what was planted, what the night decided or which notice it sent, its wall
    time (train's share), each store's size, and what retention freed."""
    mib = 1024 * 1024

    def notice(night: dict[str, Any]) -> str:
        return ", ".join(f"{n['kind']} at {n['stage']}" for n in night["notices"]) or "-"

    def freed(night: dict[str, Any]) -> str:
        retain = night.get("retention") or {}
        total = (retain.get("dvc_cache_bytes") or 0) + (retain.get("mlflow_bytes") or 0)
        return f"{total / mib:.1f}" if retain else "-"

    rows = [[n["night"], n["planted"] or "-", n["images_listed_new"], n["decision"], notice(n),
             n["wall_s"], n["stage_seconds"].get("train", "-"),
             *[f"{n['storage_bytes'][store] / mib:.1f}" for store in NIGHT_STORES], freed(n)]
            for n in record["results"]["nights"]]
    return table(["night", "planted", "new images", "decision", "notices", "wall s", "train s",
                  *[f"{label} MiB" for label in NIGHT_STORES.values()], "retention freed MiB"],
                 rows, right=8)


NIGHT_STORES = {"dvc_cache": "DVC cache", "dvc_remote": "DVC remote",
                "mlflow_artifacts": "MLflow artifacts", "download_store": "download store",
                "mlflow_db": "mlflow.db"}


RENDERERS: dict[str, Callable[[Record], str]] = {
    "speed_vs_openclip": speed_vs_openclip, "loader": loader, "retrieval": retrieval,
    "data_dedupe": data_dedupe, "data_shard": data_shard, "data_download": data_download,
    "data_urlguard": data_urlguard, "checkpoint": checkpoint,
    "export_fp16_parity": export_fp16_parity, "mutation": mutation,
    "mutation_tiers": mutation_tiers, "serving": serving,
    "default_run": default_run, "time_to_quality": time_to_quality,
    "time_to_quality_seed1": time_to_quality, "time_to_quality_levers": time_to_quality,
    "kill_recovery": kill_recovery, "quality_vs_openclip": quality_vs_openclip,
    "quality_vs_openclip_levers": quality_vs_openclip,
    "rehearsal": rehearsal, "search_at_size": search_at_size,
    "incremental_download": incremental_download, "warm_start": warm_start,
    "storage_growth": storage_growth, "storage_growth_prune_remote": storage_growth,
    "nights": nights,
}
SIZE_SUFFIX = re.compile(r"-\d+$")  # rehearsal-2000, rehearsal-123287: one renderer per benchmark


def renderer(name: str) -> Callable[[Record], str]:
    """NAME's renderer; for a benchmark recorded once per size (NAME-<size>), the benchmark's."""
    return RENDERERS.get(name) or RENDERERS.get(SIZE_SUFFIX.sub("", name), plain)


# ---- the document ----------------------------------------------------------------------------


# Blocks that keep, after the figures of their result file, what they held from before the file
# existed and the file does not replace yet: NAME -> (record, the block as it was) -> that part.
EARLIER: dict[str, Callable[[Record, str], str]] = {"mutation": mutation_earlier}


def render_block(name: str, results: Path = RESULTS, previous: str = "") -> str | None:
    """The block's text from its result file (and, for a block of EARLIER, the part of
    `previous`, its text as it was, that the file does not replace); None when the file does not
    exist yet."""
    path = results / f"{name}.json"
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    body = measured(record) + renderer(name)(record)
    return body + EARLIER[name](record, previous) if name in EARLIER else body


def render(doc: str, results: Path = RESULTS) -> tuple[str, list[str]]:
    """The document with every block whose file exists rendered, and the names still pending."""
    pending: list[str] = []

    def replace(match: re.Match[str]) -> str:
        body = render_block(match["name"], results, match["body"])
        if body is None:
            pending.append(match["name"])
            return match[0]
        return match[1] + body + match[4]

    return BLOCK.sub(replace, doc), pending


def orphans(docs: list[str], results: Path = RESULTS) -> list[str]:
    """Result files that no block of the documents renders."""
    named = {m["name"] for doc in docs for m in BLOCK.finditer(doc)}
    return sorted(p.stem for p in results.glob("*.json") if p.stem not in named)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a table differs from its result file")
    parser.add_argument("--doc", type=Path, action="append",
                        help="a document to render (repeatable; default: RESULTS.md and the "
                        "docs pages with rendered blocks)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    paths = args.doc or list(DOCS)
    docs = [path.read_text() for path in paths]
    differs = False
    for path, doc in zip(paths, docs, strict=True):
        new, pending = render(doc, args.results)
        if pending:
            print(f"{path.name}: pending (no result file yet): {', '.join(pending)}")
        if not args.check:
            path.write_text(new)
        elif new != doc:
            sys.stdout.writelines(difflib.unified_diff(doc.splitlines(True), new.splitlines(True),
                                                       str(path), "rendered"))
            print(f"{path} differs from its result files: run python "
                  "benchmarks/render_results.py", file=sys.stderr)
            differs = True
    unused = orphans(docs, args.results)
    if unused:
        print(f"result files no table renders: {', '.join(unused)}", file=sys.stderr)
    return 1 if unused or differs else 0


if __name__ == "__main__":
    sys.exit(main())
