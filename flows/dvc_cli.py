"""The DVC commands the pipeline flow needs, as plain functions (no Prefect: they test alone).

Every command runs `dvc` as a subprocess in the workspace: DVC holds a repo lock while it works and
is not safe to run twice at once, so callers run these one after another, never in parallel.
"""

# tested by: tests/flows/test_deploy.py

from __future__ import annotations

import graphlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from clipms.utils.redact import redact_text

# Lines DVC prints for a stage it executes (repro and repro --dry).
_RUNNING = re.compile(r"^Running stage '([^']+)'")
_CACHED = re.compile(r"^Stage '([^']+)' is cached - skipping run")
_DOT_EDGE = re.compile(r'^"([^"]+)"\s*->\s*"([^"]+)";?$')
_DOT_NODE = re.compile(r'^"([^"]+)";?$')
# A bad params value is not transient: retrying the stage cannot fix it.
_CONFIG_ERRORS = ("ParamsError", "params.yaml: invalid '")  # pipeline/params.py's messages


class DvcError(RuntimeError):
    """A dvc command failed; the message holds its own output (the stage's error included)."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output

    @property
    def is_config_error(self) -> bool:
        """True when the failure is a params validation error (retrying will not help)."""
        return any(marker in self.output for marker in _CONFIG_ERRORS)


@dataclass(frozen=True)
class StageRun:
    """What `dvc repro --single-item <stage>` did."""

    stage: str
    ran: bool            # DVC executed the stage's command (it was not up to date, or forced)
    restored: bool       # DVC restored the outputs from its run cache instead of running
    changed: bool        # the stage's dvc.lock entry differs afterwards (new inputs or outputs)
    seconds: float
    output: str


def tool_env() -> dict[str, str]:
    """The environment for dvc and the stage commands: this interpreter's bin dir first on PATH.

    Stage commands are `python -m stages.<name>`, which runs whatever `python` is first on PATH, so
    the worker's venv must come first even when the worker was started from another shell.
    """
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("DVC_NO_ANALYTICS", "1")
    env.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    env.setdefault("WANDB_MODE", "disabled")
    env.setdefault("GLOG_v", "3")
    return env


def dvc(args: list[str], cwd: Path, on_line: Callable[[str], None] | None = None,
        env: Mapping[str, str] | None = None) -> str:
    """Run `dvc <args>` in `cwd` (with `env` added to the environment), streaming lines to
    `on_line`; raise DvcError on failure."""
    cmd = [sys.executable, "-m", "dvc", *args]
    lines: list[str] = []
    with subprocess.Popen(cmd, cwd=cwd, env={**tool_env(), **(env or {})}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = redact_text(line.rstrip("\n"))  # no URL secret reaches a log or a notice
            lines.append(line)
            if on_line is not None and line.strip():
                on_line(line)
        code = proc.wait()
    output = "\n".join(lines)
    if code != 0:
        raise DvcError(f"`dvc {' '.join(args)}` exited {code}:\n{_tail(output)}", output)
    return output


def _tail(output: str, lines: int = 40) -> str:
    return "\n".join(output.strip().splitlines()[-lines:])


def declared_stages(workdir: Path) -> list[str]:
    """Stage names in the order dvc.yaml declares them."""
    path = workdir / "dvc.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the flow must run in a DVC project checkout")
    return list((yaml.safe_load(path.read_text()) or {}).get("stages") or {})


def stage_order(workdir: Path) -> list[str]:
    """All pipeline stages in the order DVC would run them (from `dvc dag --dot`).

    Ties (stages with no dependency between them) keep their dvc.yaml order, so the order is stable.
    """
    nodes, edges = parse_dot(dvc(["dag", "--dot"], workdir))
    declared = declared_stages(workdir)
    rank = {name: i for i, name in enumerate(declared)}
    stages = [n for n in nodes if not n.endswith(".dvc")]
    return topological(stages, [(a, b) for a, b in edges if a in stages and b in stages],
                       key=lambda n: (rank.get(n.split("@")[0], len(rank)), n))


def parse_dot(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """Nodes and (upstream, downstream) edges of `dvc dag --dot` output."""
    nodes: list[str] = []
    edges: list[tuple[str, str]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if edge := _DOT_EDGE.match(line):
            edges.append((edge.group(1), edge.group(2)))
        elif node := _DOT_NODE.match(line):
            nodes.append(node.group(1))
    return nodes, edges


def topological(nodes: list[str], edges: list[tuple[str, str]],
                key: Callable[[str], Any]) -> list[str]:
    """`nodes` in dependency order (`edges` are (upstream, downstream)); among the stages ready to
    run, the smallest `key` goes first, so the order is stable. graphlib finds what is ready and
    names a cycle; the choice among ready stages is ours (graphlib hands them out unordered)."""
    sorter: graphlib.TopologicalSorter[str] = graphlib.TopologicalSorter({n: () for n in nodes})
    for upstream, downstream in edges:
        sorter.add(downstream, upstream)
    try:
        sorter.prepare()
    except graphlib.CycleError as err:
        cycle = " -> ".join(err.args[1])
        raise ValueError(f"dvc.yaml has a dependency cycle: {cycle}") from None
    order: list[str] = []
    ready: list[str] = []
    while sorter.is_active():
        ready = sorted([*ready, *sorter.get_ready()], key=key)
        order.append(ready.pop(0))
        sorter.done(order[-1])
    return order


def select(order: list[str], wanted: Iterable[str] | None) -> list[str]:
    """The wanted stages in pipeline order (all when `wanted` is None); unknown names are errors."""
    if wanted is None:
        return list(order)
    wanted = list(wanted)
    unknown = [s for s in wanted if s not in order]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; the pipeline has {order}")
    return [s for s in order if s in wanted]


def changed_stages(workdir: Path, targets: list[str] | None = None) -> dict[str, Any]:
    """`dvc status --json [targets]`: {stage: reasons} for every stage (of `targets`, default
    all) that is not up to date."""
    out = dvc(["status", "--json", *(targets or [])], workdir)
    start = out.find("{")
    return json.loads(out[start:]) if start >= 0 else {}


def lock_entry(workdir: Path, stage: str) -> Any:
    """The stage's entry in dvc.lock (None before its first run)."""
    path = workdir / "dvc.lock"
    if not path.is_file():
        return None
    return ((yaml.safe_load(path.read_text()) or {}).get("stages") or {}).get(stage)


def repro_stage(workdir: Path, stage: str, force: bool = False,
                on_line: Callable[[str], None] | None = None,
                env: Mapping[str, str] | None = None) -> StageRun:
    """`dvc repro --single-item [--force] <stage>`: run one stage if DVC says it changed."""
    import time

    before = lock_entry(workdir, stage)
    started = time.monotonic()
    args = ["repro", "--single-item", *(["--force"] if force else []), stage]
    output = dvc(args, workdir, on_line, env)
    lines = output.splitlines()
    ran = any(m.group(1) == stage for m in map(_RUNNING.match, lines) if m)
    restored = any(m.group(1) == stage for m in map(_CACHED.match, lines) if m)
    return StageRun(stage=stage, ran=ran, restored=restored and not ran,
                    changed=lock_entry(workdir, stage) != before,
                    seconds=time.monotonic() - started, output=output)


def dry_run(workdir: Path, stages: list[str], force: bool = False) -> tuple[dict[str, Any], str]:
    """What DVC would do: `dvc status` reasons and `dvc repro --dry` for the selected stages."""
    status = changed_stages(workdir)
    try:
        text = dvc(["repro", "--dry", "--single-item", *(["--force"] if force else []), *stages],
                   workdir)
    except DvcError as err:
        # `--dry` cannot hash the inputs of a stage whose upstream outputs do not exist yet
        # (a fresh checkout); the `dvc status` answer above still stands.
        text = f"{err}\n(dvc repro --dry stops at the first stage whose inputs do not exist yet)"
    return {s: status[s] for s in stages if s in status}, text


def override_args(overrides: dict[str, Any]) -> list[str]:
    """{"train.epochs": 3} -> ["train.epochs=3"]: the `dvc exp run -S` (Hydra override) syntax.
    An interpolation is refused (`check_no_interpolation`)."""
    check_no_interpolation(overrides)
    return [f"{key}={_hydra_value(value)}" for key, value in overrides.items()]


def check_no_interpolation(overrides: dict[str, Any]) -> None:
    """ValueError for an override key or value holding `${`: Hydra (in DVC's `-S` code) resolves
    interpolations such as `${oc.env:NAME}` where the flow runs, which would copy a worker's
    environment variable (a token, a password) into params.yaml, the run's logs and the
    experiment. An override gives the value itself."""
    def texts(value: Any) -> list[str]:
        if isinstance(value, str):
            return [value]
        if isinstance(value, list | tuple):
            return [text for item in value for text in texts(item)]
        if isinstance(value, dict):
            return [text for k, v in value.items() for text in (*texts(k), *texts(v))]
        return []

    for key, value in overrides.items():
        if any("${" in text for text in texts(key) + texts(value)):
            shown = redact_text(repr(value))[:200]
            raise ValueError(
                f"override '{redact_text(str(key))[:200]}' = {shown}: '${{' starts an "
                "interpolation (such as ${oc.env:NAME}), which would be resolved on the worker "
                "that runs the flow and copy what it names into params; give the value itself")


def _hydra_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        # Quote strings unless they are plain words, so '1e-3 ' or 'a b' stay strings.
        return value if re.fullmatch(r"[A-Za-z_][\w.\-/]*", value) else json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    return str(value)


def apply_overrides(workdir: Path, overrides: dict[str, Any]) -> None:
    """Apply overrides to `workdir`'s params.yaml exactly as `dvc exp run -S` does.

    This is DVC's own `-S` code path (`dvc.utils.hydra.apply_overrides`), so the syntax and the
    errors are DVC's. The flow calls it on its private workspace only (flows/worktree.py), never
    on the user's checkout.
    """
    from dvc.utils.hydra import apply_overrides as dvc_apply

    check_no_interpolation(overrides)  # before anything is written
    params = workdir / "params.yaml"
    original = params.read_text()
    sections = yaml.safe_load(original) or {}
    for key in overrides:
        if key.split(".")[0] not in sections:
            raise ValueError(f"override '{key}': no section '{key.split('.')[0]}' in params.yaml "
                             f"(sections: {sorted(sections)})")
    try:
        dvc_apply(params, override_args(overrides))
    except Exception as err:  # DVC/Hydra raise several types; all mean "bad override"
        params.write_text(original)
        raise ValueError(f"cannot apply overrides {overrides}: {err}") from err


def save_experiment(workdir: Path, name: str) -> str:
    """`dvc exp save -n <name>`: record the workspace (params, lock, metrics) as an experiment.

    DVC leaves untracked metrics files out of a saved experiment (`dvc exp show` would then have no
    numbers for it), so the metrics dvc.yaml declares are included explicitly.
    """
    include = [arg for path in metrics_files(workdir) for arg in ("-I", path)]
    return dvc(["exp", "save", "--force", "-n", name, *include], workdir)


def metrics_files(workdir: Path) -> list[str]:
    """The `metrics:` files of every stage in dvc.yaml that exist in the workspace."""
    stages = (yaml.safe_load((workdir / "dvc.yaml").read_text()) or {}).get("stages") or {}
    paths = [next(iter(entry)) if isinstance(entry, dict) else str(entry)
             for stage in stages.values() for entry in stage.get("metrics") or []]
    return [p for p in dict.fromkeys(paths) if (workdir / p).is_file()]
