"""clipms.model.clip's initialisation is open_clip's, tensor by tensor.

The expected distributions are written out from open_clip 3.3.0's source and torch's defaults, not
taken from clipms: open_clip/transformer.py `TextTransformer.init_parameters` (the CLIP paper's
init for the text blocks and embeddings), `VisionTransformer.__init__` (class/positional embedding
and proj: width^-0.5 * randn) and its `init_parameters`, a no-op, so the vision blocks and conv1
keep PyTorch's defaults: nn.MultiheadAttention._reset_parameters (xavier_uniform_ on the fused
(3D, D) in_proj_weight, in_proj_bias and out_proj.bias zero) and nn.Linear / nn.Conv2d
reset_parameters (kaiming_uniform_(a=sqrt(5)) = U(+-1/sqrt(fan_in)) for the weight, U(+-1/sqrt(
fan_in)) for the bias; open_clip resets no Linear bias, so the MLP biases of both towers keep it).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import clipms  # noqa: F401  (sets MindSpore's environment before mindspore is imported)

# isort: split
import mindspore as ms

from clipms.model.architecture import CLIPConfig, get_preset, resolve_model
from clipms.model.clip import CLIP


def openclip_init(name: str, cfg: CLIPConfig) -> tuple[str, float]:
    """(kind, scale) of open_clip's init for our parameter `name`: ("normal", std),
    ("uniform", bound), ("const", value)."""
    tower = cfg.vision if name.startswith("visual.") else cfg.text
    width, layers = tower.width, tower.layers
    hidden = int(width * tower.mlp_ratio)
    leaf = name.rsplit(".", 2)[-2:]  # e.g. ["q_proj", "weight"]
    if name == "logit_scale":
        return "const", math.log(1 / 0.07)
    if leaf[1] in ("gamma", "beta"):  # nn.LayerNorm: ones, zeros
        return "const", 1.0 if leaf[1] == "gamma" else 0.0
    if ".attn." in name and leaf[1] == "bias":  # MHA: in_proj_bias, out_proj.bias = 0
        return "const", 0.0
    if ".mlp." in name and leaf[1] == "bias":  # nn.Linear's default bias, never reset
        return "uniform", (width if leaf[0] == "c_fc" else hidden) ** -0.5
    if name.startswith("visual.stem."):  # ConvStem: nn.Conv2d's default, fan_in 9 C_in / C_in
        channels = cfg.vision.stem_channels
        if leaf[0] == "proj":  # the 1x1 convolution: weight and bias
            return "uniform", channels[-1] ** -0.5
        return "uniform", (9 * channels[int(leaf[0])]) ** -0.5  # convs.<i>.weight
    fixed = {
        "visual.class_embedding": ("normal", cfg.vision.width**-0.5),
        "visual.positional_embedding": ("normal", cfg.vision.width**-0.5),
        "visual.proj": ("normal", cfg.vision.width**-0.5),
        "visual.patch_embed.weight": ("uniform", (3 * cfg.vision.patch_size**2) ** -0.5),
        "text.token_embedding.embedding_table": ("normal", 0.02),
        "text.positional_embedding": ("normal", 0.01),
        "text.text_projection": ("normal", cfg.text.width**-0.5),
    }
    if name in fixed:
        return fixed[name]
    assert leaf[1] == "weight", f"no open_clip init known for {name}"
    proj_std = width**-0.5 * (2 * layers) ** -0.5
    if name.startswith("text."):  # TextTransformer.init_parameters
        std = {"q_proj": width**-0.5, "k_proj": width**-0.5, "v_proj": width**-0.5,
               "out_proj": proj_std, "c_fc": (2 * width) ** -0.5, "c_proj": proj_std}[leaf[0]]
        return "normal", std
    xavier = math.sqrt(6 / (width + 3 * width))  # fan_in D, fan_out 3D (the fused in_proj)
    bound = {"q_proj": xavier, "k_proj": xavier, "v_proj": xavier, "out_proj": width**-0.5,
             "c_fc": width**-0.5, "c_proj": hidden**-0.5}[leaf[0]]
    return "uniform", bound


def check(name: str, values: np.ndarray, kind: str, scale: float) -> None:
    """values drawn from the distribution? Mean, std (6 sigma of their sampling error), support."""
    x = values.astype(np.float64).ravel()
    n = x.size
    if kind == "const":
        np.testing.assert_allclose(x, scale, rtol=1e-6, err_msg=name)
        return
    std = scale if kind == "normal" else scale / math.sqrt(3)
    assert abs(x.mean()) < 6 * std / math.sqrt(n), (name, x.mean(), std)
    # sd of the sample std: std * sqrt((kurtosis - 1) / 4n); kurtosis 3 (normal), 1.8 (uniform)
    kurtosis = 3.0 if kind == "normal" else 1.8
    assert abs(x.std() / std - 1) < 6 * math.sqrt((kurtosis - 1) / (4 * n)), (name, x.std(), std)
    peak = np.abs(x).max()
    if kind == "uniform":  # inside [-bound, bound], and reaching near it
        assert peak <= scale * (1 + 1e-6) and peak > scale * (1 - 20 / n), (name, peak, scale)
    elif n >= 1000:  # a normal's tail: P(max |x| < 2.5 std) < 1e-5 for n >= 1000
        assert peak > 2.5 * std, (name, peak, std)


@pytest.mark.parametrize("preset", ["mini", "tiny", "mini-conv"])
def test_every_tensor_starts_as_open_clips(preset):
    cfg = (resolve_model("mini", {"vision": {"stem": "conv"}}) if preset == "mini-conv"
           else get_preset(preset))  # the conv stem: PyTorch's nn.Conv2d defaults
    ms.set_seed(0)
    net = CLIP(cfg)
    for name, param in net.parameters_and_names():  # openclip_init fails on a name it lacks
        check(name, param.asnumpy(), *openclip_init(name, cfg))
