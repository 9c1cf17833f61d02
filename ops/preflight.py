"""`python -m ops.preflight`: check a host and a training configuration before a long run.

It reads params.yaml (plus `--profile FILE` and `-S key=value` overrides, the syntax of
`dvc exp run -S`), checks the environment -- MindSpore's own `run_check()`, the devices the run
needs and can see, what msrun and HCCL need, shared memory for the loader's workers, disk for the
checkpoints -- and the plan -- a full global batch from the train split of the shard manifest, more
steps than warmup -- and prints what the run would do and the `dvc exp run` command that applies
the overrides. It exits 1 when a check fails. Nothing is trained or written; `run_check()` runs
one multiplication on MindSpore's default device. With `--smoke` it then trains a few amp steps
twice and exports on the run's device (ops/smoke.py), one line per check. docs/ascend.md
explains each check.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import ipaddress
import json
import os
import re
import shutil
import socket
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from clipms.model.architecture import DEFAULT_PRESET, CLIPConfig, get_preset
from ops.checks import FAIL, OK, WARN, Check

# HCCL's host ports (root-info communicators, what msrun's dynamic cluster creates), from
# HCCL_IF_BASE_PORT (default 60000): 16 ports up to CANN 8.1, 32 from 8.2 (CANN's
# HCCL_IF_BASE_PORT pages: 8.0.0 "16 ports, 60000-60015"; 8.3.RC1 "32 ports, 60000-60031"; the
# 8.2.RC1 page says 32 in its description and 60000-60015 in its sysctl line, so 32 is used).
# An unknown version gets 32: reserving 16 ports more than needed costs nothing.
HCCL_BASE_PORT = 60000
HCCL_PORTS_FROM = ((8, 2), 32)  # (first CANN version, ports); before it 16
RESERVED_PORTS = Path("/proc/sys/net/ipv4/ip_local_reserved_ports")
# msrun sets these for every worker; a value already in the environment would fight it.
MSRUN_OWNED = ("MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_WORKER_NUM", "MS_NODE_ID")
MSCOCO_TRAIN_IMAGES = 118_287  # MSCOCO 2017 train: the figure used when no manifest exists yet
SHM_SHARE = 0.8  # MindSpore refuses shared-memory queues above 80% of free /dev/shm
OPENAI_VOCAB = 49408  # ids of the OpenAI CLIP vocabulary (tokenizer.kind: openai)


@dataclass(frozen=True)
class RunPlan:
    """The training settings a preflight looks at; defaults are stages.train.TrainParams' own
    and (device_target, mode) clipms.runtime.RuntimeConfig's (tests/ops/test_preflight.py checks
    that they agree)."""

    preset: str = DEFAULT_PRESET
    device_target: str = "CPU"
    mode: str = "graph"
    precision: str = "fp32"
    batch_size: int = 64
    accum_steps: int = 1
    epochs: int = 8
    max_steps: int | None = None
    warmup_steps: int = 30
    workers: int | str = "auto"
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    ranks: int = 1  # train.distributed.workers
    nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    image_size: int | None = None  # from the preset (and train.model overrides)

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> RunPlan:
        train = dict(params.get("train") or {})
        dist = dict(train.pop("distributed", None) or {})
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in train.items() if k in known}
        values.update(ranks=dist.get("workers", 1), **{k: dist[k] for k in (
            "nodes", "node_rank", "master_addr", "master_port") if k in dist})
        runtime = params.get("runtime") or {}  # the device and mode: clipms.runtime's section
        values.update({k: runtime[k] for k in ("device_target", "mode") if k in runtime})
        return cls(**values, image_size=model_config(params).vision.image_size)

    @property
    def local_ranks(self) -> int:
        return max(1, self.ranks // max(1, self.nodes))

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.accum_steps * self.ranks


def model_config(params: dict[str, Any]) -> CLIPConfig:
    """The model the train stage would build: the preset, `train.model` overrides, and the
    vocabulary and context length of the tokenizer the `tokenizer` section asks for."""
    train, tok = params.get("train") or {}, params.get("tokenizer") or {}
    base = get_preset(train.get("preset", RunPlan.preset)).to_dict()
    for key, value in (train.get("model") or {}).items():
        base[key] = {**base[key], **value} if isinstance(value, dict) else value
    if tok.get("kind") == "bpe" and "vocab_size" in tok:  # at most this many ids
        base["text"]["vocab_size"] = tok["vocab_size"]
    elif tok.get("kind") == "openai":
        base["text"]["vocab_size"] = OPENAI_VOCAB
    if "context_length" in tok:
        base["text"]["context_length"] = tok["context_length"]
    return CLIPConfig.from_dict(base)


def parameter_count(cfg: CLIPConfig) -> int:
    """Parameters of `clipms.model.clip.CLIP(cfg)`, counted from the config alone."""
    def blocks(width: int, layers: int, mlp_ratio: float) -> int:
        hidden = int(width * mlp_ratio)
        attention = 4 * (width * width + width)
        mlp = width * hidden + hidden + hidden * width + width
        return layers * (attention + mlp + 4 * width)  # + two LayerNorms

    v, t, e = cfg.vision, cfg.text, cfg.embed_dim
    c = v.stem_channels  # the conv stem's 3x3 convolutions (+ LayerNorm) and 1x1 (+ bias)
    convs = sum(9 * a * b + 2 * b for a, b in zip(c, c[1:], strict=False))
    stem = convs + (c[-1] + 1) * v.width if v.stem == "conv" else 3 * v.patch_size**2 * v.width
    vision = (stem + v.width + v.num_tokens * v.width + 4 * v.width
              + v.width * e + blocks(v.width, v.layers, v.mlp_ratio))
    text = (t.vocab_size * t.width + t.context_length * t.width + 2 * t.width + t.width * e
            + blocks(t.width, t.layers, t.mlp_ratio))
    return vision + text + 1  # + logit_scale


# --- environment ------------------------------------------------------------------------------
def check_mindspore() -> Check:
    try:
        import mindspore as ms
    except ImportError as err:
        return Check("mindspore", FAIL, f"cannot import mindspore: {err}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ms.run_check()  # prints its verdict; runs one Mul on the default device
    text = " ".join(out.getvalue().split())
    status = OK if "successfully" in text else FAIL
    return Check("mindspore.run_check", status, text or "no output")


def ascend_devices() -> list[str]:
    return sorted(p.name for p in Path("/dev").glob("davinci[0-9]*"))


def check_devices(plan: RunPlan) -> Check:
    if plan.device_target == "CPU":
        return Check("devices", OK, f"CPU: {plan.local_ranks} process(es) on "
                                    f"{_usable_cores()} usable cores")
    if plan.device_target == "GPU":
        found = shutil.which("nvidia-smi")
        return Check("devices", OK if found else FAIL,
                     "nvidia-smi found" if found else "GPU requested, nvidia-smi not found")
    devices = ascend_devices()
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    count = len(visible.split(",")) if visible else len(devices)
    backend = _ascend_backend()
    if not devices or not backend:
        toolkit = os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
        return Check("devices", FAIL, "no Ascend device is present on this host ("
                     + (", ".join(devices) if devices else "no /dev/davinci*") + "; npu-smi "
                     + ("found" if shutil.which("npu-smi") else "not found") + "; CANN "
                     + (toolkit or "not set up (source its set_env.sh)") + "; MindSpore's Ascend "
                     + ("backend loads" if backend else "backend is not available") + ")")
    if count < plan.local_ranks:
        return Check("devices", FAIL, f"{plan.local_ranks} ranks on this host but {count} "
                     f"visible NPU(s) ({', '.join(devices)}; ASCEND_RT_VISIBLE_DEVICES="
                     f"{visible})")
    return Check("devices", OK, f"{count} visible NPU(s) for {plan.local_ranks} rank(s)")


def _ascend_backend() -> bool:
    import mindspore as ms

    try:
        return bool(ms.hal.is_available("Ascend"))
    except Exception:  # noqa: BLE001 - any failure to load the backend means "not available"
        return False


def check_launcher(plan: RunPlan) -> list[Check]:
    checks = []
    if plan.ranks > 1:
        exe = shutil.which("msrun") or str(Path(sys.executable).parent / "msrun")
        checks.append(Check("msrun", OK if Path(exe).exists() else FAIL, exe))
    clash = [name for name in MSRUN_OWNED if name in os.environ]
    if clash:
        checks.append(Check("environment", WARN, f"{', '.join(clash)} already set: msrun sets "
                            "them for each worker; unset them"))
    if plan.nodes > 1:
        checks.extend(_check_cluster(plan))
    if plan.device_target == "Ascend" and plan.ranks > 1:
        checks.append(check_hccl_ports(cann_version(os.environ), os.environ,
                                       _read(RESERVED_PORTS)))
    if plan.device_target == "Ascend" and plan.nodes > 1:
        iface = os.environ.get("HCCL_IF_IP") or os.environ.get("HCCL_SOCKET_IFNAME")
        checks.append(Check("hccl", OK if iface else WARN, f"HCCL host NIC: {iface}" if iface
                            else "neither HCCL_IF_IP nor HCCL_SOCKET_IFNAME is set: HCCL picks "
                            "a NIC by name order, and it must reach node 0's"))
    return checks


def cann_version(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """(major, minor) of the CANN toolkit set_env.sh points at, from its install record
    (`<toolkit>/<arch>-linux/ascend_toolkit_install.info`, `version=8.3.RC1`), or None."""
    home = environ.get("ASCEND_HOME_PATH") or environ.get("ASCEND_TOOLKIT_HOME")
    if not home:
        return None
    for info in sorted(Path(home).glob("*/ascend_toolkit_install.info")) + [
            Path(home) / "ascend_toolkit_install.info"]:
        match = re.search(r"^version=(\d+)\.(\d+)", _read(info) or "", re.MULTILINE)
        if match:
            return int(match.group(1)), int(match.group(2))
    return None


def hccl_port_range(version: tuple[int, int] | None,
                    environ: Mapping[str, str]) -> tuple[int, int]:
    """The host ports HCCL uses on this CANN version: HCCL_IF_BASE_PORT (default 60000) and the
    15 or 31 after it."""
    first_version, ports = HCCL_PORTS_FROM
    count = 16 if version is not None and version < first_version else ports
    base = int(environ.get("HCCL_IF_BASE_PORT") or HCCL_BASE_PORT)
    return base, base + count - 1


def check_hccl_ports(version: tuple[int, int] | None, environ: Mapping[str, str],
                     reserved: str | None) -> Check:
    """HCCL's port range is in `net.ipv4.ip_local_reserved_ports` (else an outgoing connection
    may take one of them first and HCCL's init fails now and then)."""
    if environ.get("HCCL_HOST_SOCKET_PORT_RANGE"):  # CANN 8.5: takes priority over the base
        return Check("hccl ports", OK, "HCCL_HOST_SOCKET_PORT_RANGE="
                     f"{environ['HCCL_HOST_SOCKET_PORT_RANGE']} chooses HCCL's host ports "
                     "(reserve them unless 'auto')")
    low, high = hccl_port_range(version, environ)
    cann = f"CANN {version[0]}.{version[1]}" if version else "CANN version unknown"
    taken = _port_set(reserved or "")
    missing = [port for port in range(low, high + 1) if port not in taken]
    if not missing:
        return Check("hccl ports", OK, f"{low}-{high} reserved ({cann})")
    wanted = ",".join(filter(None, [(reserved or "").strip(), f"{low}-{high}"]))
    return Check("hccl ports", WARN, f"HCCL uses ports {low}-{high} ({cann}) but "
                 f"{len(missing)} of them are not reserved: another connection can take one "
                 f"first; run `sysctl -w net.ipv4.ip_local_reserved_ports={wanted}` (and add it "
                 "to /etc/sysctl.conf)")


def _port_set(text: str) -> set[int]:
    """The ports of a reserved-ports list such as `60000-60015,61000`."""
    ports: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, _, high = part.partition("-")
        ports.update(range(int(low), int(high or low) + 1))
    return ports


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _check_cluster(plan: RunPlan) -> list[Check]:
    try:
        address = ipaddress.ip_address(socket.gethostbyname(plan.master_addr))
    except (OSError, ValueError) as err:
        return [Check("master_addr", FAIL, f"{plan.master_addr} does not resolve: {err}")]
    if address.is_loopback:
        return [Check("master_addr", FAIL, f"{plan.master_addr} is a loopback address: the "
                      "other hosts cannot reach node 0 there; set node 0's address")]
    checks = [Check("master_addr", OK, f"{plan.master_addr} -> {address}")]
    if plan.master_port is None:
        checks.append(Check("master_port", FAIL, "several hosts need the same fixed port"))
    return checks


def check_shared_memory(plan: RunPlan, workers: int, row_bytes: int) -> Check:
    """MindSpore's own check for multiprocessing loaders (`_check_shm_usage` of
    mindspore/dataset/engine/datasets_user_defined.py, 2.10): ranks on the host (at most 8
    counted) x workers x (queue + 2) rows against 80% of free /dev/shm, the queue as MindSpore's
    loader sizes it from its prefetch setting. MindSpore runs it itself only for a fixed
    `max_rowsize`; the loader uses the default (rows allocated at their own size), so the
    preflight runs it with the loader's real row size. Ranks are folded into the worker count:
    outside msrun MindSpore counts a group of one."""
    if workers <= 1:
        return Check("shared memory", OK, "one decode worker per rank: no shared-memory queue")
    from mindspore.dataset import config as ds_config
    from mindspore.dataset.engine.datasets_user_defined import _check_shm_usage

    prefetch = ds_config.get_prefetch_size()
    queue = max(2, min(prefetch, prefetch * 4 // workers))
    processes = min(plan.local_ranks, 8) * workers
    need = processes * (queue + 2) * row_bytes
    try:
        _check_shm_usage(processes, queue, 0, row_bytes / 2**20)  # MB, as max_rowsize
    except RuntimeError as err:
        first = str(err).splitlines()[0]
        return Check("shared memory", FAIL, f"MindSpore's check: {first} (the loader needs "
                     f"~{_mb(need)}; containers: --shm-size or --ipc=host)")
    free = shutil.disk_usage("/dev/shm").free
    return Check("shared memory", OK, f"MindSpore's check passes: the loader needs ~{_mb(need)} "
                 f"of /dev/shm, {_mb(free)} free")


def check_disk(folder: Path, plan: RunPlan, params: int, stale_sets: int) -> Check:
    """Weights + two AdamW moments in fp32 per checkpoint; `keep` of them, one being written,
    and the set-aside sets of earlier configurations (clipms.train.checkpoint)."""
    per_checkpoint = 3 * 4 * params
    need = per_checkpoint * (plan.keep_checkpoints + 1 + stale_sets * plan.keep_checkpoints)
    probe = folder if folder.exists() else Path.cwd()
    free = shutil.disk_usage(probe).free
    return Check("disk", OK if need < free else FAIL,
                 f"{_mb(per_checkpoint)} a checkpoint, up to {_mb(need)} in {folder} with "
                 f"{stale_sets} stale sets kept; {_mb(free)} free")


# --- the plan ---------------------------------------------------------------------------------
def check_schedule(plan: RunPlan, train_samples: int | None, source: str,
                   val_fraction: float = 0.1) -> list[Check]:
    if train_samples is None:
        assumed = int(MSCOCO_TRAIN_IMAGES * (1 - val_fraction))
        return [Check("train split", WARN, f"{source}; assumed {assumed} samples (MSCOCO 2017 "
                      f"train's {MSCOCO_TRAIN_IMAGES} images less dedupe.val_fraction "
                      f"{val_fraction})")] + check_schedule(plan, assumed, "assumed")
    micro = train_samples // (plan.batch_size * plan.ranks)  # micro-batches an epoch
    if micro < plan.accum_steps:
        return [Check("global batch", FAIL, f"{train_samples} train samples ({source}) cannot "
                      f"fill one global batch of {plan.global_batch} (batch_size "
                      f"{plan.batch_size} x accum_steps {plan.accum_steps} x {plan.ranks} ranks)")]
    total = plan.max_steps or plan.epochs * micro // plan.accum_steps
    checks = [Check("global batch", OK, f"{plan.global_batch} samples a step; "
                    f"{micro // plan.accum_steps} steps an epoch of {train_samples} ({source})")]
    if plan.warmup_steps >= total:
        checks.append(Check("warmup", FAIL, f"{total} steps in all, warmup {plan.warmup_steps}: "
                            "the learning rate never leaves warmup"))
    elif plan.warmup_steps > total // 2:
        checks.append(Check("warmup", WARN, f"warmup {plan.warmup_steps} of {total} steps"))
    else:
        checks.append(Check("warmup", OK, f"warmup {plan.warmup_steps} of {total} steps"))
    if plan.checkpoint_every > total:
        checks.append(Check("checkpoints", WARN, f"checkpoint_every {plan.checkpoint_every} > "
                            f"{total} steps: only the final checkpoint is written"))
    if plan.precision == "amp" and plan.device_target == "CPU":
        checks.append(Check("precision", WARN, "amp on CPU runs, but slower than fp32"))
    return checks


def check_image_size(download: dict[str, Any], model_side: int) -> Check:
    """The downloaded images (the `download` params section) against the model's input: smaller
    ones are upscaled every step."""
    # img2dataset keeps each image's own size; YAML 1.1 reads an unquoted `no` as false
    if download.get("resize_mode") in ("no", False):
        return Check("image size", OK, "download.resize_mode no: images keep their own size, "
                     f"not checked against the model's {model_side}-px input")
    downloaded = download.get("image_size") or default_download_size()
    if downloaded < model_side:
        return Check("image size", WARN, f"download.image_size {downloaded} < the model's "
                     f"{model_side}-px input: every image is upscaled (set download.image_size "
                     f">= {model_side}, as profiles/ do)")
    return Check("image size", OK, f"downloaded at {downloaded} px, the model takes {model_side}")


def default_download_size() -> int:
    """The download stage's image size when params do not set one (imported only then: the
    download module brings pandas, pyarrow and fsspec with it)."""
    from prep.fetch import DownloadSettings

    return DownloadSettings().image_size


def train_split_size(manifest: Path) -> tuple[int | None, str]:
    try:
        splits = json.loads(manifest.read_text())["splits"]
        return int(splits["train"]["samples"]), str(manifest)
    except FileNotFoundError:
        return None, f"no {manifest} yet (run the pipeline up to `shard`)"
    except (KeyError, TypeError, ValueError) as err:
        return None, f"{manifest} has no train split sample count ({err})"


def preflight(params: dict[str, Any], manifest: Path, checkpoints: Path,
              stale_sets: int) -> tuple[RunPlan, list[Check], dict[str, Any]]:
    """(plan, checks, what the run would do) for a params dict; nothing runs or is written."""
    from clipms.data.decode import loader_workers

    plan = RunPlan.from_params(params)
    model = model_config(params)
    count = parameter_count(model)
    workers = loader_workers(plan.workers, plan.local_ranks)
    row_bytes = 3 * plan.image_size**2 + 4 * model.text.context_length  # uint8 pixels, int32 ids
    samples, source = train_split_size(manifest)
    checks = [check_mindspore(), check_devices(plan), *check_launcher(plan),
              check_shared_memory(plan, workers, row_bytes),
              check_disk(checkpoints, plan, count, stale_sets),
              check_image_size(params.get("download") or {}, plan.image_size),
              *check_schedule(plan, samples, source,
                              (params.get("dedupe") or {}).get("val_fraction", 0.1))]
    runtime = runtime_settings(params.get("runtime") or {}, checks)
    summary = {"device": plan.device_target, "mode": plan.mode, "precision": plan.precision,
               "jit_level": runtime.get("jit_level"), "kernel_fusion": runtime.get("kernel_fusion"),
               "compile_cache": runtime.get("compile_cache"), "data_sink": runtime.get("data_sink"),
               "preset": plan.preset, "parameters": count, "image_size": plan.image_size,
               "ranks": plan.ranks, "nodes": plan.nodes, "ranks_per_node": plan.local_ranks,
               "global_batch": plan.global_batch, "loader_workers_per_rank": workers,
               "writes_outputs": plan.node_rank == 0}
    return plan, checks, summary


def runtime_settings(section: dict[str, Any], checks: list[Check]) -> dict[str, Any]:
    """What clipms.runtime would set for the `runtime` section (jit level, fusion, environment);
    an invalid section becomes a failed check."""
    from pydantic import ValidationError

    from clipms.runtime import CACHE_SWITCH, FORCE_CACHE, RuntimeConfig, settings_for

    try:
        settings = settings_for(RuntimeConfig(**section)).to_dict()
    except ValidationError as err:
        checks.append(Check("runtime", FAIL, f"invalid runtime section: {err.errors()[0]['msg']} "
                            f"({err.errors()[0]['loc']})"))
        return {}
    on_off = {True: "on", False: "off"}
    checks.append(Check("runtime", OK, f"jit_level {settings['jit_level']}, kernel fusion "
                        f"{on_off[settings['kernel_fusion']]}, compile cache "
                        f"{'keyed per training run' if settings['compile_cache'] else 'off'}, "
                        f"data sink {on_off[settings['data_sink']]}; sets "
                        + ", ".join(sorted({**settings['import_env'], **settings['env']}))))
    stray = [f"{name}={os.environ[name]}" for name in (CACHE_SWITCH, FORCE_CACHE)
             if os.environ.get(name, "0") not in ("0", "")]
    if stray:
        checks.append(Check("compile cache", WARN, f"{', '.join(stray)} in the environment is "
                            "ignored (an unkeyed cache reuses graphs across changed runs): set "
                            "runtime.compile_cache: true instead"))
    return settings


def dvc_command(overrides: dict[str, Any]) -> str:
    """The command that runs the pipeline with `overrides` (`dvc repro` without any)."""
    if not overrides:
        return "dvc repro"
    return "dvc exp run " + " ".join(f"-S '{key}={_yaml_value(value)}'"
                                     for key, value in overrides.items())


def _yaml_value(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def apply_overrides(params: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    params = json.loads(json.dumps(params))  # a deep copy
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = params
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return params


def _usable_cores() -> int:
    from clipms.data.decode import usable_cores

    return usable_cores()


def _mb(n: float) -> str:
    return f"{n / 2**20:,.0f} MB" if n < 2**30 else f"{n / 2**30:,.1f} GB"


def smoke_checks(params: dict[str, Any], checks: list[Check]) -> list[Check]:
    """The smoke run's checks (ops.smoke), unless the host cannot run it at all."""
    blocking = [c.name for c in checks if c.status == FAIL and c.name in (
        "mindspore.run_check", "devices", "runtime")]
    if blocking:
        return [Check("smoke", FAIL, f"not run: the {', '.join(blocking)} check failed")]
    from ops.smoke import run_smoke, smoke_plan

    return run_smoke(smoke_plan(params, model_config(params)))


def main(argv: list[str] | None = None) -> int:
    from clipms.train.checkpoint import KEEP_STALE_SETS
    from pipeline.params import read_params

    parser = argparse.ArgumentParser(prog="python -m ops.preflight", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--profile", type=Path, action="append", default=[],
                        help="a YAML file of dotted overrides (profiles/*.yaml)")
    parser.add_argument("-S", "--set", action="append", default=[], metavar="KEY=VALUE",
                        help="one override, as `dvc exp run -S`")
    parser.add_argument("--manifest", type=Path, default=Path("data/shards/manifest.json"))
    parser.add_argument("--checkpoints", type=Path, default=Path("models/checkpoints"))
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    parser.add_argument("--smoke", action="store_true",
                        help="then train a few amp steps twice and export on the device "
                             "(ops/smoke.py; minutes)")
    args = parser.parse_args(argv)

    overrides: dict[str, Any] = {}
    for profile in args.profile:
        overrides.update(yaml.safe_load(profile.read_text()) or {})
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"-S {item!r}: expected KEY=VALUE")
        overrides[key] = yaml.safe_load(value)
    params = apply_overrides(read_params(args.params), overrides)
    plan, checks, summary = preflight(params, args.manifest, args.checkpoints, KEEP_STALE_SETS)
    if args.smoke:
        checks.extend(smoke_checks(params, checks))
    command = dvc_command(overrides)
    failed = any(c.status == FAIL for c in checks)
    if args.json:
        print(json.dumps({"plan": summary, "checks": [asdict(c) for c in checks],
                          "command": command, "passed": not failed}))
    else:
        for c in checks:
            print(f"[{c.status:>4}] {c.name}: {c.detail}")
        print("run: " + ", ".join(f"{k} {v}" for k, v in summary.items()))
        print(f"apply with: {command}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
