"""CLIP architecture as data: dataclass configs, presets, and open_clip model-config JSON import.

The field names follow open_clip's `CLIPVisionCfg`/`CLIPTextCfg` so that a config read from an
open_clip model JSON and a preset written here mean the same thing. Only the options that describe
open_clip's standard ViT CLIP are supported; anything else (timm/HF towers, layer scale, attentional
pooling, ...) is rejected by `CLIPConfig.from_openclip` with an error naming the option.
"""

# tested by: tests/clipms/deploy/test_mindir.py

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class VisionConfig:
    """ViT image tower."""

    image_size: int = 224  # square input side in pixels; must be a multiple of patch_size
    patch_size: int = 32  # side of the square patches that become tokens
    width: int = 768  # transformer width (token dimension)
    layers: int = 12  # number of residual attention blocks
    head_width: int = 64  # open_clip stores per-head width; heads = width // head_width
    mlp_ratio: float = 4.0  # MLP hidden size = width * mlp_ratio
    # How pixels become tokens. patch: open_clip's linear patch embedding. conv: a stack of
    # log2(patch_size) stride-2 3x3 convolutions + a 1x1 one (Xiao et al. 2021, "Early
    # Convolutions Help Transformers See Better"), the same token grid; not an open_clip tower.
    stem: str = "patch"
    # Share of the patch tokens dropped at random per sample in every training forward (open_clip's
    # PatchDropout, FLIP: Li et al. 2023; the class token is always kept). Never in evaluation or
    # export. 0 = off. clipms.model.patch_dropout says how the draws are seeded.
    patch_dropout: float = 0.0

    @property
    def heads(self) -> int:
        return self.width // self.head_width

    @property
    def grid_size(self) -> int:
        return self.image_size // self.patch_size

    @property
    def stem_channels(self) -> tuple[int, ...]:
        """stem 'conv': channels from the image through its log2(patch_size) stride-2 3x3
        convolutions, doubling up to the width (3, D/8, D/4, D/2, D for 16-px patches)."""
        depth = self.patch_size.bit_length() - 1
        return (3, *(max(self.width >> (depth - 1 - i), 1) for i in range(depth)))

    @property
    def num_tokens(self) -> int:
        return self.grid_size**2 + 1  # patches + class token

    def validate(self) -> None:
        _positive("vision", image_size=self.image_size, patch_size=self.patch_size,
                  width=self.width, layers=self.layers, head_width=self.head_width,
                  mlp_ratio=self.mlp_ratio)
        if self.image_size % self.patch_size:
            raise ValueError(
                f"vision.image_size={self.image_size} is not a multiple of "
                f"vision.patch_size={self.patch_size}"
            )
        if self.width % self.head_width:
            raise ValueError(
                f"vision.width={self.width} is not a multiple of "
                f"vision.head_width={self.head_width}"
            )
        if isinstance(self.patch_dropout, bool) or not 0 <= self.patch_dropout < 1:
            raise ValueError(
                f"vision.patch_dropout={self.patch_dropout!r} must be a share in [0, 1) "
                "(0 = off; open_clip recommends 0.5-0.75 for large models)"
            )
        if self.stem not in STEMS:
            raise ValueError(f"vision.stem={self.stem!r} is not one of {list(STEMS)}")
        if self.stem == "conv" and (self.patch_size < 2 or self.patch_size & (self.patch_size - 1)):
            raise ValueError(
                f"vision.stem='conv' needs a power-of-two vision.patch_size (stride-2 "
                f"convolutions), not {self.patch_size}"
            )


STEMS = ("patch", "conv")


@dataclass(frozen=True)
class TextConfig:
    """Causal text transformer, pooled at the EOT token (the highest token id)."""

    context_length: int = 77  # tokens per caption, SOT and EOT included, padded with 0
    vocab_size: int = 49408  # the OpenAI BPE vocabulary; the train stage uses its tokenizer's size
    width: int = 512  # transformer width
    heads: int = 8  # attention heads; head width = width // heads
    layers: int = 12  # number of residual attention blocks
    mlp_ratio: float = 4.0  # MLP hidden size = width * mlp_ratio

    def validate(self) -> None:
        _positive("text", context_length=self.context_length, vocab_size=self.vocab_size,
                  width=self.width, heads=self.heads, layers=self.layers,
                  mlp_ratio=self.mlp_ratio)
        if self.width % self.heads:
            raise ValueError(
                f"text.width={self.width} is not a multiple of text.heads={self.heads}"
            )


@dataclass(frozen=True)
class CLIPConfig:
    """Both towers plus the shared embedding size."""

    embed_dim: int = 512  # size of the joint image/text embedding space
    vision: VisionConfig = field(default_factory=VisionConfig)
    text: TextConfig = field(default_factory=TextConfig)
    quick_gelu: bool = False  # x*sigmoid(1.702x) as OpenAI's released weights; else exact GELU
    init_logit_scale: float = math.log(1 / 0.07)  # CLIP paper's temperature 0.07
    # A learned scalar added to every logit (SigLIP's bias; open_clip's `init_logit_bias`); None =
    # no such parameter (CLIP). The SigLIP loss needs it (clipms.train.loss.LOSS_INIT).
    init_logit_bias: float | None = None

    def __post_init__(self) -> None:
        _positive("model", embed_dim=self.embed_dim)
        self.vision.validate()
        self.text.validate()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CLIPConfig:
        """Inverse of `to_dict`; unknown keys raise an error naming them."""
        d = dict(d)
        vision = _build(VisionConfig, d.pop("vision", {}), "vision")
        text = _build(TextConfig, d.pop("text", {}), "text")
        top = _build(_TopLevel, d, "model")
        return cls(vision=vision, text=text, **dataclasses.asdict(top))

    @classmethod
    def from_openclip(cls, cfg: dict[str, Any] | str | Path) -> CLIPConfig:
        """Build from an open_clip model config (a dict or a path to its JSON file)."""
        if not isinstance(cfg, dict):
            cfg = json.loads(Path(cfg).read_text())
        if "model_cfg" in cfg:  # a Hugging Face hub `open_clip_config.json` wraps it
            cfg = cfg["model_cfg"]
        return _from_openclip(cfg)

    def to_openclip(self) -> dict[str, Any]:
        """The open_clip model-config JSON for this architecture (for `open_clip.CLIP(**cfg)`)."""
        v, t = self.vision, self.text
        if v.stem != "patch":
            raise ValueError(
                f"vision.stem={v.stem!r} has no open_clip equivalent (open_clip's ViT embeds "
                "patches linearly): only vision.stem='patch' models convert to open_clip"
            )
        return {
            "embed_dim": self.embed_dim,
            "vision_cfg": {
                "image_size": v.image_size,
                "patch_size": v.patch_size,
                "width": v.width,
                "layers": v.layers,
                "head_width": v.head_width,
                "mlp_ratio": v.mlp_ratio,
                **({"patch_dropout": v.patch_dropout} if v.patch_dropout else {}),
            },
            "text_cfg": {
                "context_length": t.context_length,
                "vocab_size": t.vocab_size,
                "width": t.width,
                "heads": t.heads,
                "layers": t.layers,
                "mlp_ratio": t.mlp_ratio,
            },
            "quick_gelu": self.quick_gelu,
            # only where they are not open_clip's defaults (a SigLIP model's), as its configs do
            **({"init_logit_scale": self.init_logit_scale}
               if self.init_logit_scale != _TopLevel.init_logit_scale else {}),
            **({"init_logit_bias": self.init_logit_bias}
               if self.init_logit_bias is not None else {}),
        }


def _positive(section: str, **values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"{section}.{name}={value!r} must be a positive number")


def resolve_model(preset: str, overrides: dict[str, Any]) -> CLIPConfig:
    """A preset with `overrides` merged into it ({"vision": {"layers": 2}, "embed_dim": 128});
    a ValueError names an unknown key or an impossible architecture."""
    return CLIPConfig.from_dict(_merge(get_preset(preset).to_dict(), overrides))


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merged[key] = _merge(base[key], value)
        else:
            merged[key] = value
    return merged


@dataclass(frozen=True)
class _TopLevel:
    embed_dim: int = 512
    quick_gelu: bool = False
    init_logit_scale: float = math.log(1 / 0.07)
    init_logit_bias: float | None = None


def _build(kind: type, d: dict[str, Any], where: str) -> Any:
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"unknown {where} config key(s) {unknown}; allowed: {sorted(names)}")
    return kind(**d)


# open_clip options we accept only at the value that describes the standard CLIP ViT.
# key -> allowed values (the first is open_clip's default).
_VISION_FIXED: dict[str, tuple[Any, ...]] = {
    "ls_init_value": (None,),
    "attentional_pool": (False,),
    "no_ln_pre": (False,),
    "pos_embed_type": ("learnable",),
    "final_ln_after_pool": (False,),
    "pool_type": ("tok",),
    "timm_model_name": (None,),
    "act_kwargs": (None,),
    "norm_kwargs": (None,),
    "input_patchnorm": (False,),
    "global_average_pool": (False,),
}
_TEXT_FIXED: dict[str, tuple[Any, ...]] = {
    "ls_init_value": (None,),
    "embed_cls": (False,),
    "pad_id": (0,),
    "no_causal_mask": (False,),
    "final_ln_after_pool": (False,),
    "pool_type": ("argmax",),
    "proj_bias": (False,),
    "proj_type": ("linear",),
    "hf_model_name": (None,),
    "act_kwargs": (None,),
    "norm_kwargs": (None,),
}
# Keys that do not change the network's function.
_IGNORED = {"output_tokens", "hf_tokenizer_name", "tokenizer_kwargs", "timm_model_pretrained",
            "hf_model_pretrained", "attn_pooler_queries", "attn_pooler_heads", "timm_pool",
            "timm_proj", "timm_proj_bias", "timm_drop", "timm_drop_path", "hf_proj_type",
            "hf_pooler_type", "n_queries"}
_TOP_IGNORED = {"custom_text", "cast_dtype", "output_dict"}
_TOP_KEYS = {"embed_dim", "vision_cfg", "text_cfg", "quick_gelu", "init_logit_scale",
             "init_logit_bias"}


def _check_fixed(section: str, cfg: dict[str, Any], fixed: dict[str, tuple[Any, ...]]) -> None:
    for key, allowed in fixed.items():
        if key in cfg and cfg[key] not in allowed:
            raise ValueError(
                f"open_clip {section}.{key}={cfg[key]!r} is not supported (only {allowed[0]!r}); "
                "clipms implements the standard CLIP ViT"
            )


def _pick(section: str, cfg: dict[str, Any], names: set[str], fixed: dict) -> dict[str, Any]:
    unknown = sorted(set(cfg) - names - set(fixed) - _IGNORED)
    if unknown:
        raise ValueError(f"unsupported open_clip {section} key(s) {unknown}")
    _check_fixed(section, cfg, fixed)
    return {k: cfg[k] for k in names if k in cfg}


def _from_openclip(cfg: dict[str, Any]) -> CLIPConfig:
    for key in ("embed_dim", "vision_cfg", "text_cfg"):
        if key not in cfg:
            raise ValueError(f"open_clip model config has no {key!r}")
    extra = sorted(set(cfg) - _TOP_KEYS - _TOP_IGNORED)
    if extra:
        raise ValueError(f"unsupported open_clip model config key(s) {extra}")
    vcfg = dict(cfg["vision_cfg"])
    if not isinstance(vcfg.get("layers", 12), int):
        raise ValueError("open_clip vision_cfg.layers is a list: ResNet towers are not supported")
    v_names = {f.name for f in dataclasses.fields(VisionConfig)} - {"stem"}  # clipms's own
    t_names = {f.name for f in dataclasses.fields(TextConfig)}
    vision = VisionConfig(**_pick("vision_cfg", vcfg, v_names, _VISION_FIXED))
    text = TextConfig(**_pick("text_cfg", dict(cfg["text_cfg"]), t_names, _TEXT_FIXED))
    bias = cfg.get("init_logit_bias")
    return CLIPConfig(
        embed_dim=int(cfg["embed_dim"]),
        vision=vision,
        text=text,
        quick_gelu=bool(cfg.get("quick_gelu", False)),
        init_logit_scale=float(cfg.get("init_logit_scale", _TopLevel.init_logit_scale)),
        init_logit_bias=None if bias is None else float(bias),
    )


PRESETS: dict[str, CLIPConfig] = {
    # CPU tests and benchmarks: trains in minutes on 2 cores (19.2M parameters).
    "tiny": CLIPConfig(
        embed_dim=256,
        vision=VisionConfig(image_size=64, patch_size=8, width=256, layers=4, head_width=64),
        text=TextConfig(context_length=32, width=256, heads=4, layers=4),
    ),
    # The default run's model (params.yaml): tiny at half width with 16-px patches (17 image tokens
    # instead of 65). A step costs a fraction of tiny's, so the default run's minutes buy the many
    # steps that learning shape (not only colour) needs: benchmarks/RESULTS.md, "The default run".
    "mini": CLIPConfig(
        embed_dim=128,
        vision=VisionConfig(image_size=64, patch_size=16, width=128, layers=4, head_width=32),
        text=TextConfig(context_length=32, width=128, heads=4, layers=3),
    ),
    # A step up for a longer CPU run or a single accelerator: 8x8 patches of 128 px, ViT-S widths.
    "small": CLIPConfig(
        embed_dim=384,
        vision=VisionConfig(image_size=128, patch_size=16, width=384, layers=6, head_width=64),
        text=TextConfig(context_length=77, width=384, heads=6, layers=6),
    ),
    # open_clip's ViT-B-32.json and ViT-B-16.json.
    "ViT-B-32": CLIPConfig(
        embed_dim=512,
        vision=VisionConfig(image_size=224, patch_size=32, width=768, layers=12, head_width=64),
        text=TextConfig(context_length=77, vocab_size=49408, width=512, heads=8, layers=12),
    ),
    "ViT-B-16": CLIPConfig(
        embed_dim=512,
        vision=VisionConfig(image_size=224, patch_size=16, width=768, layers=12, head_width=64),
        text=TextConfig(context_length=77, vocab_size=49408, width=512, heads=8, layers=12),
    ),
}


# The preset of a train section that names none: the default run's (params.yaml says the same, and
# tests/stages/test_train.py checks that the two agree).
DEFAULT_PRESET = "mini"


def get_preset(name: str) -> CLIPConfig:
    """A preset by name; an unknown name raises an error listing the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None
