#!/usr/bin/env python3
"""Golden fixture for the vision tower + projector backward (transformers 5.17.0 autograd, fp32).

A random vision tower of a deliberately small geometry (patch 2, so a pixel row has 3·2·2·2 = 24
values; width 16 with 2 heads of 8; depth 2) in float32 with eager attention, every parameter
redrawn (norm weights near 1, biases non-zero, the SwiGLU projections scaled up so that both clamps
bite). Three inputs run through it, each differentiated on its own:

  single   one image, grid (1, 4, 6)
  multi    a pack of three images, grids (1, 2, 4), (1, 4, 4), (1, 2, 2)
  video    one video of three tubelets, grid (3, 2, 4), run as `Glm5NextModel.get_video_features`
           runs it: the grid flattened to three (1, 2, 4) rows (every tubelet its own attention
           segment, positions restarting at (0, 0))

The loss of each case is sum(pooler_output ⊙ d_pooler) for a random d_pooler, so the gradients are
those of the upstream gradient d_pooler.

Tensors (tower.safetensors-like names):
  param.model.visual.<name> f32      the redrawn parameters (shared by the three cases)
  <case>.pixel_values f32 [N, 24], <case>.grid_thw i64 [G, 3] (the un-flattened grid for video),
  <case>.d_pooler f32 [N/4, O], <case>.pooler_output f32 [N/4, O], <case>.d_pixels f32 [N, 24],
  <case>.grad.model.visual.<name> f32 (the parameter's shape)
Metadata "vision_config" (JSON): the config fields of the geometry.

Usage: python tools/golden/vision_backward.py   (a Python with transformers 5.17.0 and torch)
"""

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

import transformers
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextVisionConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "golden" / "vision" / "tower_backward.safetensors"

assert transformers.__version__ == "5.17.0", transformers.__version__
SEED = 20260601

GEOMETRY = dict(depth=2, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=24,
                projection_intermediate_size=32, patch_size=2, temporal_patch_size=2,
                spatial_merge_size=2, in_channels=3, image_size=8, swiglu_limit=4.0)

CASES = {
    "single": ([[1, 4, 6]], False),
    "multi": ([[1, 2, 4], [1, 4, 4], [1, 2, 2]], False),
    "video": ([[3, 2, 4]], True),
}


def redraw(model, gen):
    params = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(("norm1.weight", "norm2.weight",
                                                               "layernorm.weight")):
                value = 1.0 + 0.2 * torch.randn(p.shape, generator=gen)
            elif p.dim() == 1:
                value = 0.1 * torch.randn(p.shape, generator=gen)
            else:
                value = torch.randn(p.shape, generator=gen) / math.sqrt(p[0].numel())
            if name.endswith(("gate_proj.weight", "up_proj.weight")):
                value = value * 4.0  # push some pre-activations past the clamp limit
            p.copy_(value)
            params["param.model.visual." + name] = value.clone().contiguous()
    return params


def count_clamps(model, limit):
    counts = {"gate": 0, "up": 0}

    def hook(module, inputs, output):
        x = inputs[0]
        counts["gate"] += int((module.gate_proj(x) > limit).sum())
        counts["up"] += int((module.up_proj(x).abs() > limit).sum())

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if type(m).__name__ in ("Glm5NextVisionMLP", "Glm5NextVisionPatchMerger")]
    return counts, handles


def main():
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    config = Glm5NextVisionConfig(**GEOMETRY)
    config._attn_implementation = "eager"
    model = Glm5NextVisionModel(config).float().train()
    gen = torch.Generator().manual_seed(SEED)
    tensors = redraw(model, gen)
    row = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    merge = config.spatial_merge_size ** 2
    for case, (grid_rows, is_video) in CASES.items():
        grid = torch.tensor(grid_rows, dtype=torch.int64)
        n = int(grid.prod(-1).sum())
        pixels = (torch.randn((n, row), generator=gen) * 1.2).requires_grad_(True)
        run_grid = grid
        if is_video:  # as get_video_features: every tubelet its own (1, h, w) row
            hw = torch.repeat_interleave(grid[:, 1:], grid[:, 0], dim=0)
            run_grid = torch.cat([hw.new_ones(hw.shape[0], 1), hw], dim=1)
        d_pooler = torch.randn((n // merge, config.out_hidden_size), generator=gen)
        model.zero_grad(set_to_none=True)
        counts, handles = count_clamps(model, config.swiglu_limit)
        out = model(pixels, grid_thw=run_grid)
        for h in handles:
            h.remove()
        assert counts["gate"] > 0 and counts["up"] > 0, (case, counts)
        (out.pooler_output * d_pooler).sum().backward()
        tensors[f"{case}.pixel_values"] = pixels.detach().contiguous()
        tensors[f"{case}.grid_thw"] = grid
        tensors[f"{case}.d_pooler"] = d_pooler.contiguous()
        tensors[f"{case}.pooler_output"] = out.pooler_output.detach().contiguous()
        tensors[f"{case}.d_pixels"] = pixels.grad.detach().contiguous()
        for name, p in model.named_parameters():
            assert p.grad is not None, f"{case}: no gradient for {name}"
            tensors[f"{case}.grad.model.visual.{name}"] = p.grad.detach().contiguous()
        print(f"{case}: {n} rows, clamped {counts}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(OUT), metadata={"vision_config": json.dumps(GEOMETRY, sort_keys=True)})
    size = OUT.stat().st_size
    assert size < 400_000, f"fixture is {size} bytes"
    print(f"{OUT.name}: {size} bytes")


if __name__ == "__main__":
    main()
