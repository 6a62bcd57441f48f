"""Read Bridge's torch_dist checkpoints back with ``megatron.core.dist_checkpointing``.

Compares each model weight a checkpoint holds with the fp32 main param of the same checkpoint
(the distributed optimizer's per-bucket ``param`` tensor, cut at the buffer layout the run
recorded), rounded the way the param stores it: MXFP8 for the emulated-MXFP8 weights, bf16 for
the rest. ``load_plain_tensors`` needs a process group; the reader runs on one spawned gloo rank.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_MAIN_PARAM_KEY = re.compile(
    r"optimizer\.distributed\.dp_group_idx_0\.gbuf_idx_(\d+)\..*\.bucket_idx_(\d+)\.param$"
)


def saved_steps(root: str) -> list[int]:
    return sorted(int(p.name.removeprefix("iter_")) for p in Path(root).glob("iter_*"))


def _ckpt_key(name: str) -> tuple[str, int | None]:
    """Model param name -> (checkpoint key, layer index in the stacked tensor or None)."""
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)$", name)
    if not m:
        return name, None
    layer, rest = int(m.group(1)), m.group(2)
    rest = rest.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_").replace(
        "pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"
    )
    return f"decoder.layers.{rest}", layer


def _worst_on_rank(root: str, step: int, layout: dict[str, Any], mxfp8_names: list[str]) -> dict[str, float]:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from megatron.core import dist_checkpointing

    from mbridge_mxfp8_plugin.testing import mxfp8_quantize

    sd = dist_checkpointing.load_plain_tensors(str(Path(root) / f"iter_{step:07d}"))
    flat = {}
    for key, value in sd.items():
        m = _MAIN_PARAM_KEY.match(key)
        if m:
            flat[(int(m.group(1)), int(m.group(2)))] = value
    worst: dict[str, float] = {}
    for name, (g, b, start, end, shape) in layout.items():
        main = flat[(g, b)][start:end].view(shape).float()
        key, layer = _ckpt_key(name)
        saved = sd[key] if layer is None else sd[key][layer]
        if name in mxfp8_names:
            want = mxfp8_quantize(main.to(torch.bfloat16))
        else:
            want = main.to(torch.bfloat16).float()
        worst[name] = float((saved.float() - want).abs().max())
    return worst


def weights_vs_main_params(
    root: str, step: int, layout: dict[str, Any], mxfp8_names: list[str]
) -> dict[str, float]:
    """param name -> max |checkpointed weight - rounded main param| at ``step``."""
    from mbridge_mxfp8_plugin.testing.launcher import launch

    return launch(_worst_on_rank, 1, root, step, layout, mxfp8_names)[0]
