"""Writes siglip.npz and patch_dropout.npz beside this file: open_clip's own outputs for the SigLIP
loss and for patch dropout, which tests/test_loss.py and tests/test_patch_dropout.py compare
clipms against. Run it with a Python that has torch and open_clip_torch (not project
dependencies; benchmarks/openclip_fit.py says how to make such a venv):

    PEER_VENV/bin/python tests/data/openclip/make_siglip_golden.py

Everything is drawn from fixed seeds; rerunning it rewrites the same numbers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import open_clip
import torch
from open_clip.loss import SigLipLoss
from open_clip.transformer import PatchDropout
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent


def siglip_cases() -> dict[str, np.ndarray]:
    """SigLipLoss (one process) and its gradients for unit features at three (scale, bias):
    open_clip's initial one (10, -10), a trained-looking one, and an aligned batch."""
    out: dict[str, np.ndarray] = {}
    gen = torch.Generator().manual_seed(0)
    cases = [(8, 16, math.log(10), -10.0, False), (12, 32, math.log(30), -4.5, False),
             (6, 8, math.log(100), -2.0, True)]
    for i, (n, d, log_scale, bias, aligned) in enumerate(cases):
        image = torch.nn.functional.normalize(torch.randn(n, d, generator=gen, dtype=torch.float64))
        text = image + 0.1 * torch.randn(n, d, generator=gen, dtype=torch.float64) if aligned \
            else torch.randn(n, d, generator=gen, dtype=torch.float64)
        text = torch.nn.functional.normalize(text)
        image, text = image.float().requires_grad_(), text.float().requires_grad_()
        log_s = torch.tensor(log_scale, requires_grad=True)
        b = torch.tensor(bias, requires_grad=True)
        loss = SigLipLoss()(image, text, log_s.exp(), b)
        loss.backward()
        for key, value in {"image": image, "text": text, "log_scale": log_s, "bias": b}.items():
            out[f"case{i}_{key}"] = value.detach().numpy()
            out[f"case{i}_grad_{key}"] = value.grad.numpy()
        out[f"case{i}_loss"] = loss.detach().numpy()
    return out


def patch_dropout_cases() -> dict[str, np.ndarray]:
    """PatchDropout(prob) on random tokens, with the torch.randn draw it made recorded; and the
    micro_gelu image tower (vision patch_dropout 0.5, training mode) on its golden images."""
    out: dict[str, np.ndarray] = {}
    draws: list[torch.Tensor] = []
    randn = torch.randn

    def recording_randn(*args, **kwargs):  # PatchDropout's only random call
        value = randn(*args, **kwargs)
        draws.append(value.clone())
        return value

    torch.manual_seed(1)
    for i, (prob, n, patches, width) in enumerate([(0.5, 3, 16, 5), (0.25, 2, 49, 4),
                                                   (0.75, 4, 9, 3)]):
        x = torch.randn(n, 1 + patches, width)
        draws.clear()
        torch.randn = recording_randn
        try:
            y = PatchDropout(prob).train()(x)
        finally:
            torch.randn = randn
        out |= {f"case{i}_prob": np.float32(prob), f"case{i}_x": x.numpy(),
                f"case{i}_rand": draws[0].numpy(), f"case{i}_out": y.numpy()}

    config = json.loads((HERE / "micro_gelu.json").read_text())
    config["vision_cfg"]["patch_dropout"] = 0.5
    model = open_clip.model.CLIP(**config)
    model.load_state_dict(load_file(str(HERE / "micro_gelu.safetensors")))
    images = torch.from_numpy(np.load(HERE / "micro_gelu.npz")["images"])
    draws.clear()
    torch.randn = recording_randn
    try:
        with torch.no_grad():
            features = model.train().encode_image(images)
    finally:
        torch.randn = randn
    out |= {"tower_rand": draws[0].numpy(), "tower_image_features": features.numpy(),
            "tower_patch_dropout": np.float32(0.5)}
    return out


def siglip_model_keys() -> dict[str, np.ndarray]:
    """The state-dict names of an open_clip CLIP trained with --siglip (init_logit_bias set)."""
    config = json.loads((HERE / "micro_gelu.json").read_text())
    model = open_clip.model.CLIP(**config, init_logit_scale=math.log(10), init_logit_bias=-10)
    state = model.state_dict()
    return {"state_keys": np.asarray(sorted(state)), "logit_bias": state["logit_bias"].numpy(),
            "logit_scale": state["logit_scale"].numpy()}


def main() -> None:
    np.savez(HERE / "siglip.npz", **siglip_cases(), **siglip_model_keys(),
             versions=np.asarray([open_clip.__version__, torch.__version__]))
    np.savez(HERE / "patch_dropout.npz", **patch_dropout_cases(),
             versions=np.asarray([open_clip.__version__, torch.__version__]))
    print("wrote", HERE / "siglip.npz", HERE / "patch_dropout.npz")


if __name__ == "__main__":
    main()
