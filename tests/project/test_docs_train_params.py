"""docs/training.md's table of the `train` params states each default; params.yaml owns them.
The table is checked against the file, so a changed default cannot leave the docs behind (the
table said `tiny`, 8 epochs and lr 5e-4 for three defaults after all three had changed)."""

from __future__ import annotations

import re

import yaml

from harness.dvc_workspace import PROJECT_ROOT

ROW = re.compile(r"^\| (`[^|]+`(?:(?:, | / )`[^|]+`)*) \| ([^|]+) \|", re.MULTILINE)


def documented_defaults() -> dict[str, object]:
    """{key: default} from the table's rows; "a, b" / "a / b" rows give one value per key."""
    text = (PROJECT_ROOT / "docs/training.md").read_text()
    table = text.split("## Parameters (`params.yaml`, section `train`)", 1)[1].split("\n\n", 2)[1]
    found: dict[str, object] = {}
    for keys, default in ROW.findall(table):
        names = re.findall(r"`([^`]+)`", keys)
        raw = default.strip().replace("`", "")
        values = re.split(r", (?![^\[]*\])| / ", raw) if len(names) > 1 else [raw]
        if len(values) == 1:  # one default for every key of the row
            values *= len(names)
        assert len(values) == len(names), (keys, default)
        for name, value in zip(names, values, strict=True):
            found[name] = parse(value)
    return found


def parse(value: str) -> object:
    """A default as YAML reads it, and 5e-4 as the number it is (YAML 1.1 wants 5.0e-4)."""
    parsed = yaml.safe_load(value)
    if isinstance(parsed, str):
        try:
            return float(parsed)
        except ValueError:
            return parsed
    return parsed


def lookup(section: dict, dotted: str) -> object:
    node: object = section
    for part in dotted.split("."):
        assert isinstance(node, dict) and part in node, f"train.{dotted} is not in params.yaml"
        node = node[part]
    return node


def test_the_train_params_table_states_params_yaml_defaults():
    train = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text())["train"]
    documented = documented_defaults()
    assert {"preset", "model", "epochs", "lr", "warmup_steps", "seed"} <= set(documented)
    wrong = {key: (value, lookup(train, key)) for key, value in documented.items()
             if value != lookup(train, key)}
    assert wrong == {}, f"docs/training.md default != params.yaml: {wrong}"
