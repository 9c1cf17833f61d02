"""open_clip (PyTorch) weights <-> MindSpore CLIP, through safetensors (no pickles, no torch).

    python -m clipms.model.convert from-openclip --config C.json --weights W.safetensors \
        --out M.ckpt
    python -m clipms.model.convert to-openclip --checkpoint M.ckpt --out W.safetensors

A MindSpore checkpoint travels with a sidecar config `M.json` beside `M.ckpt`, in the format of
`models/clip.json`: {"model": CLIPConfig.to_dict(), "tokenizer": ..., "preprocess": {...}}.
`to-openclip` also writes the open_clip model config `W.json` beside `W.safetensors`.

Name/layout mapping (open_clip -> clipms), everything else is a rename only:
  visual.conv1.weight (D,3,p,p)          -> visual.patch_embed.weight (D, 3*p*p)   reshape
  *.attn.in_proj_weight (3D,D) / _bias   -> *.attn.{q,k,v}_proj.weight (D,D) / .bias   split
  *.ln_*.weight / .bias                  -> *.ln_*.gamma / .beta
  token_embedding.weight                 -> text.token_embedding.embedding_table
  positional_embedding, transformer.*, ln_final.*, text_projection -> text.<same>
  logit_scale, logit_bias (SigLIP models: `init_logit_bias` in the config) -> the same names
A model with `vision.stem: conv` (clipms's convolutional stem) has no open_clip counterpart and
is refused both ways.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

from clipms.model.architecture import CLIPConfig
from clipms.utils.atomic import atomic_write, write_text

# open_clip's image preprocessing for OpenAI-style weights (open_clip.constants).
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)

# Buffers some open_clip versions save that carry no learned weights (the causal mask).
_IGNORED_OPENCLIP_KEYS = {"attn_mask", "visual.attn_mask"}
# What a model that trained with patch dropout holds besides its weights: the count of its draws
# (clipms.model.patch_dropout). open_clip's PatchDropout draws from torch's generator: no tensor.
_PATCH_DROPOUT_STATE = "patch_dropout.draws"


class ConversionError(ValueError):
    """A state dict does not match the architecture; the message names every offending tensor."""


def _require_patch_stem(cfg: CLIPConfig) -> None:
    if cfg.vision.stem != "patch":
        raise ConversionError(
            f"vision.stem={cfg.vision.stem!r}: open_clip has no such image tower (its ViT embeds "
            "patches linearly); only vision.stem='patch' models convert to or from open_clip"
        )


def _block_shapes(prefix: str, width: int, hidden: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.ln_1.weight": (width,),
        f"{prefix}.ln_1.bias": (width,),
        f"{prefix}.attn.in_proj_weight": (3 * width, width),
        f"{prefix}.attn.in_proj_bias": (3 * width,),
        f"{prefix}.attn.out_proj.weight": (width, width),
        f"{prefix}.attn.out_proj.bias": (width,),
        f"{prefix}.ln_2.weight": (width,),
        f"{prefix}.ln_2.bias": (width,),
        f"{prefix}.mlp.c_fc.weight": (hidden, width),
        f"{prefix}.mlp.c_fc.bias": (hidden,),
        f"{prefix}.mlp.c_proj.weight": (width, hidden),
        f"{prefix}.mlp.c_proj.bias": (width,),
    }


def openclip_shapes(cfg: CLIPConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of open_clip's `CLIP(**cfg).state_dict()` with its shape."""
    v, t, e = cfg.vision, cfg.text, cfg.embed_dim
    shapes: dict[str, tuple[int, ...]] = {
        "logit_scale": (),
        "visual.conv1.weight": (v.width, 3, v.patch_size, v.patch_size),
        "visual.class_embedding": (v.width,),
        "visual.positional_embedding": (v.num_tokens, v.width),
        "visual.ln_pre.weight": (v.width,),
        "visual.ln_pre.bias": (v.width,),
        "visual.ln_post.weight": (v.width,),
        "visual.ln_post.bias": (v.width,),
        "visual.proj": (v.width, e),
        "token_embedding.weight": (t.vocab_size, t.width),
        "positional_embedding": (t.context_length, t.width),
        "ln_final.weight": (t.width,),
        "ln_final.bias": (t.width,),
        "text_projection": (t.width, e),
    }
    if cfg.init_logit_bias is not None:  # SigLIP's learned bias, same name on both sides
        shapes["logit_bias"] = ()
    for i in range(v.layers):
        shapes |= _block_shapes(f"visual.transformer.resblocks.{i}", v.width,
                                int(v.width * v.mlp_ratio))
    for i in range(t.layers):
        shapes |= _block_shapes(f"transformer.resblocks.{i}", t.width, int(t.width * t.mlp_ratio))
    return shapes


def check_openclip_state_dict(state: dict[str, np.ndarray], cfg: CLIPConfig) -> None:
    """Raise ConversionError naming each missing, unexpected and mis-shaped tensor."""
    expected = openclip_shapes(cfg)
    given = {k: v for k, v in state.items() if k not in _IGNORED_OPENCLIP_KEYS}
    problems = [f"missing tensor {k} (expected shape {expected[k]})"
                for k in expected if k not in given]
    problems += [f"unexpected tensor {k} (shape {tuple(given[k].shape)})"
                 for k in given if k not in expected]
    problems += [
        f"tensor {k} has shape {tuple(given[k].shape)}, expected {expected[k]}"
        for k in expected
        if k in given and tuple(given[k].shape) != expected[k]
    ]
    if problems:
        raise ConversionError(
            "open_clip state dict does not match the model config:\n  " + "\n  ".join(problems)
        )


def _rename_to_clipms(name: str) -> str:
    name = re.sub(r"\.ln_(\w+)\.weight$", r".ln_\1.gamma", name)
    name = re.sub(r"\.ln_(\w+)\.bias$", r".ln_\1.beta", name)
    name = re.sub(r"^ln_final\.weight$", "ln_final.gamma", name)
    name = re.sub(r"^ln_final\.bias$", "ln_final.beta", name)
    if name == "token_embedding.weight":
        return "text.token_embedding.embedding_table"
    if name.startswith(("positional_embedding", "transformer.", "ln_final.", "text_projection")):
        return "text." + name
    return name


def openclip_to_clipms(state: dict[str, np.ndarray], cfg: CLIPConfig) -> dict[str, np.ndarray]:
    """open_clip state dict (numpy) -> clipms parameter dict (numpy, float32)."""
    _require_patch_stem(cfg)
    check_openclip_state_dict(state, cfg)
    out: dict[str, np.ndarray] = {}
    for name, value in state.items():
        if name in _IGNORED_OPENCLIP_KEYS:
            continue
        value = np.asarray(value, dtype=np.float32)
        if name == "visual.conv1.weight":
            out["visual.patch_embed.weight"] = value.reshape(value.shape[0], -1)
        elif name.endswith((".attn.in_proj_weight", ".attn.in_proj_bias")):
            stem = _rename_to_clipms(name.rsplit(".", 1)[0])  # ...attn
            kind = "weight" if name.endswith("weight") else "bias"
            for part, chunk in zip("qkv", np.split(value, 3, axis=0), strict=True):
                out[f"{stem}.{part}_proj.{kind}"] = np.ascontiguousarray(chunk)
        else:
            out[_rename_to_clipms(name)] = value
    return out


def _rename_to_openclip(name: str) -> str:
    name = re.sub(r"\.ln_(\w+)\.gamma$", r".ln_\1.weight", name)
    name = re.sub(r"\.ln_(\w+)\.beta$", r".ln_\1.bias", name)
    if name == "text.token_embedding.embedding_table":
        return "token_embedding.weight"
    if name.startswith("text."):
        name = name[len("text."):]
    return name


def clipms_to_openclip(params: dict[str, np.ndarray], cfg: CLIPConfig) -> dict[str, np.ndarray]:
    """clipms parameter dict (numpy) -> open_clip state dict (numpy, PyTorch names and layouts)."""
    _require_patch_stem(cfg)
    out: dict[str, np.ndarray] = {}
    pending_qkv: dict[str, dict[str, np.ndarray]] = {}
    for name, value in params.items():
        if name.endswith(_PATCH_DROPOUT_STATE):  # a trainer's draw counter, not a weight
            continue
        value = np.asarray(value, dtype=np.float32)
        match = re.match(r"^(.*\.attn)\.([qkv])_proj\.(weight|bias)$", name)
        if name == "visual.patch_embed.weight":
            p = cfg.vision.patch_size
            out["visual.conv1.weight"] = value.reshape(value.shape[0], 3, p, p)
        elif match:
            stem, part, kind = match.groups()
            pending_qkv.setdefault(f"{_rename_to_openclip(stem)}.in_proj_{kind}", {})[part] = value
        else:
            out[_rename_to_openclip(name)] = value
    for name, parts in pending_qkv.items():
        missing = [p for p in "qkv" if p not in parts]
        if missing:
            raise ConversionError(f"{name}: missing {missing} projection(s)")
        out[name] = np.concatenate([parts[p] for p in "qkv"], axis=0)
    check_openclip_state_dict(out, cfg)
    return out


# ---- MindSpore side -------------------------------------------------------------------------


def build_clip(cfg: CLIPConfig, params: dict[str, np.ndarray], net=None):
    """A CLIP Cell (`net`, or a new one) with `params` (clipms names) loaded; every parameter must
    be given, exactly."""
    import mindspore as ms

    from clipms.model.clip import CLIP

    net = CLIP(cfg) if net is None else net
    own = {p.name: p for p in net.get_parameters()}
    problems = [f"missing parameter {k}" for k in own if k not in params]
    problems += [f"unexpected parameter {k}" for k in params if k not in own]
    problems += [
        f"parameter {k} has shape {tuple(params[k].shape)}, expected {tuple(own[k].shape)}"
        for k in own
        if k in params and tuple(params[k].shape) != tuple(own[k].shape)
    ]
    if problems:
        raise ConversionError("parameters do not match the model:\n  " + "\n  ".join(problems))
    for name, param in own.items():
        param.set_data(ms.Tensor(np.asarray(params[name], dtype=np.float32)))
    return net


def clip_params(net) -> dict[str, np.ndarray]:
    """The Cell's parameters as numpy arrays, by name."""
    return {p.name: p.asnumpy() for p in net.get_parameters()}


def load_openclip(config_json_path: str | Path, safetensors_path: str | Path):
    """open_clip model config JSON + open_clip safetensors -> a CLIP Cell with the weights."""
    from safetensors.numpy import load_file

    cfg = CLIPConfig.from_openclip(config_json_path)
    state = load_file(str(safetensors_path))
    return build_clip(cfg, openclip_to_clipms(state, cfg))


def sidecar_path(checkpoint: str | Path) -> Path:
    """`models/clip.ckpt` -> `models/clip.json`."""
    return Path(checkpoint).with_suffix(".json")


def save_clipms(net, checkpoint: str | Path, tokenizer: str | None = None,
                preprocess: dict | None = None) -> None:
    """Write `M.ckpt` and its sidecar `M.json` ({"model", "tokenizer", "preprocess"})."""
    import mindspore as ms

    checkpoint = Path(checkpoint)
    with atomic_write(checkpoint) as tmp:
        ms.save_checkpoint(net, str(tmp))
    cfg: CLIPConfig = net.config
    if preprocess is None:
        preprocess = {"image_size": cfg.vision.image_size, "mean": list(OPENAI_MEAN),
                      "std": list(OPENAI_STD), "interpolation": "bicubic"}
    meta = {"model": cfg.to_dict(), "tokenizer": tokenizer, "preprocess": preprocess}
    write_text(sidecar_path(checkpoint), json.dumps(meta, indent=2) + "\n")


def load_clipms(checkpoint: str | Path, config: CLIPConfig | None = None):
    """`M.ckpt` (+ sidecar `M.json` unless `config` is given) -> a CLIP Cell. Entries that are not
    model parameters (a training checkpoint's optimizer state, step counters) are skipped."""
    import mindspore as ms

    from clipms.model.clip import CLIP

    if not Path(checkpoint).is_file():
        raise FileNotFoundError(f"{checkpoint}: checkpoint not found")
    if config is None:
        meta_path = sidecar_path(checkpoint)
        if not meta_path.exists():
            raise FileNotFoundError(
                f"{meta_path} not found: the model config travels beside the checkpoint"
            )
        config = CLIPConfig.from_dict(json.loads(meta_path.read_text())["model"])
    net = CLIP(config)
    wanted = {p.name for p in net.get_parameters()}
    loaded = ms.load_checkpoint(str(checkpoint), choice_func=lambda name: name in wanted)
    return build_clip(config, {k: v.asnumpy() for k, v in loaded.items()}, net)


def save_openclip(net, out: str | Path) -> Path:
    """Write open_clip `W.safetensors` and its model config `W.json`; returns the config path."""
    from safetensors.numpy import save_file

    out = Path(out)
    state = clipms_to_openclip(clip_params(net), net.config)
    with atomic_write(out) as tmp:
        # np.ascontiguousarray would turn the 0-d logit_scale into shape (1,)
        save_file({k: np.array(v, order="C") for k, v in state.items()}, str(tmp))
    config_path = out.with_suffix(".json")
    write_text(config_path, json.dumps(net.config.to_openclip(), indent=2) + "\n")
    return config_path


# ---- CLI ------------------------------------------------------------------------------------


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m clipms.model.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    src = sub.add_parser("from-openclip", help="open_clip safetensors -> MindSpore checkpoint")
    src.add_argument("--config", required=True, help="open_clip model config JSON")
    src.add_argument("--weights", required=True, help="open_clip state dict (.safetensors)")
    src.add_argument("--out", required=True, help="MindSpore checkpoint to write (.ckpt)")
    src.add_argument("--tokenizer", default=None, help="tokenizer path to record in the sidecar")
    dst = sub.add_parser("to-openclip", help="MindSpore checkpoint -> open_clip safetensors")
    dst.add_argument("--checkpoint", required=True, help="MindSpore .ckpt (with sidecar .json)")
    dst.add_argument("--out", required=True, help="open_clip .safetensors to write")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        if args.command == "from-openclip":
            net = load_openclip(args.config, args.weights)
            save_clipms(net, args.out, tokenizer=args.tokenizer)
            print(f"wrote {args.out} and {sidecar_path(args.out)}")
        else:
            net = load_clipms(args.checkpoint)
            config_path = save_openclip(net, args.out)
            print(f"wrote {args.out} and {config_path}")
    except (ConversionError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
