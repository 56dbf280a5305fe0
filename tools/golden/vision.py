#!/usr/bin/env python3
"""Golden fixtures for image decoding, the image processor and the vision tower (transformers 5.17.0).

Needs, besides transformers 5.17.0 and torch: Pillow (the decoder the reference's image loading
uses) and torchvision (the backend of `Glm5NextImageProcessor`, the class processor_config.json
names; without torchvision transformers silently falls back to the PIL backend, which rounds the
normalisation and the resize slightly differently). Install both next to the reference stack:
`pip install pillow torchvision` (`--no-deps` keeps an already installed torch untouched).

Writes, under tests/golden/vision/:
  images/*        tiny test images made here with PIL (gradients + noise; RGB, grayscale, RGBA, LA,
                  palette, 1-bit, 16-bit grayscale PNG; PNGs with EXIF orientations 2-8;
                  baseline, 4:4:4, progressive, grayscale, CMYK and EXIF-rotated JPEGs; lossless
                  and lossy WebP; a two-frame GIF whose first frame does not cover the screen).
  decode.safetensors
                  decode.<file> f16 [H, W, 3] (byte values, exact in float16): what transformers'
                  `load_image` gives for the file (PIL open, `ImageOps.exif_transpose`,
                  `convert("RGB")`).
  processor.safetensors
                  For each case <c> (an image file at default settings, or "<file>@max<n>" with
                  a smaller max_image_tokens that forces a downscale):
                    <c>.grid_thw i64 [1, 3]; <c>.canvas f16 [3, Ht, Wt] for CANVAS_CASES (the
                    reference `resize` output: resized to the content size if needed, zero-padded
                    to the canvas);
                    <c>.row_sums f64 [N] (per-row sums of pixel_values, in float64);
                    <c>.pixel_values f32 [N, 1176] for the cases listed in FULL_PIXEL_CASES.
                  Metadata "cases" (JSON): case -> {file, max_image_tokens}.
  processor.json  geometry (smart_resize canvas, content size, patch count) for image sizes that
                  need no pixels, the placeholder expansion and mm_token_type_ids of the reference
                  processor for a token stream with images and a video.
  tower.safetensors
                  a random tiny vision tower (the `tiny` preset's vision config) in float32 with
                  eager attention, run on two images at once: param.<released name> f32,
                  pixel_values f32 [N, 1176], grid_thw i64 [2, 3], last_hidden_state f32 [N/4, O]
                  (downsample output), pooler_output f32 [N/4, O] (merger output).

Usage: python tools/golden/vision.py
"""

import io
import json
import math
import types
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps
from safetensors.torch import save_file

import transformers
from transformers.image_processing_backends import TorchvisionBackend
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextVisionConfig
from transformers.models.glm5_next.image_processing_glm5_next import Glm5NextImageProcessor, smart_resize
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel
from transformers.models.glm5_next.processing_glm5_next import Glm5NextProcessor

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "golden" / "vision"
PROCESSOR_CONFIG = REPO.parent / "shared" / "reference" / "processor_config.json"

assert transformers.__version__ == "5.17.0", transformers.__version__
SEED = 20260517

# Cases whose whole pixel_values are stored (the others store row sums only: the canvas is stored
# exactly, so together they pin the normalisation and the row/element order without megabytes).
FULL_PIXEL_CASES = ["rgb_small.png"]
# Cases whose canvas (the resized, padded uint8 image) is stored: upscales and downscales of
# several aspect ratios and sources. Row sums change by about 0.03 when one byte of a row moves by
# one, so the other cases are pinned by their row sums alone.
CANVAS_CASES = ["rgb_small.png", "photo.jpg@max20", "rgb_wide.png@max20", "lossy.webp@max17",
                "rgb_wide.png@max1", "photo444.jpg@max2"]


def gradient_noise(rng, h, w, channels):
    """Smooth ramps plus noise: exercises every byte value and makes the resize filter visible."""
    y = np.linspace(0.0, 1.0, h)[:, None, None]
    x = np.linspace(0.0, 1.0, w)[None, :, None]
    phase = np.arange(channels)[None, None, :] / max(channels, 1)
    base = 127.5 + 100.0 * np.sin(2 * math.pi * (x * 1.3 + y * 0.7 + phase))
    noise = rng.normal(0.0, 25.0, size=(h, w, channels))
    return np.clip(np.rint(base + noise), 0, 255).astype(np.uint8)


def exif_with_orientation(value):
    exif = Image.Exif()
    exif[0x0112] = value
    return exif.tobytes()


def build_images(rng):
    """name -> encoded bytes. Sizes are small on purpose (the whole set stays far below 200 KB)."""
    files = {}

    def save(name, image, fmt, **kwargs):
        buf = io.BytesIO()
        image.save(buf, fmt, **kwargs)
        files[name] = buf.getvalue()

    # Below the 16-token minimum: the processor upscales (bicubic, antialias) and pads.
    save("rgb_small.png", Image.fromarray(gradient_noise(rng, 37, 53, 3), "RGB"), "PNG")
    # Above the minimum: no resize, padding only (100 -> 112, 150 -> 168).
    save("rgb_wide.png", Image.fromarray(gradient_noise(rng, 100, 150, 3), "RGB"), "PNG")
    rgba = gradient_noise(rng, 45, 60, 4)
    rgba[:10, :, 3] = 0  # fully transparent rows keep their colour under convert("RGB")
    save("rgba.png", Image.fromarray(rgba, "RGBA"), "PNG")
    save("gray.png", Image.fromarray(gradient_noise(rng, 70, 30, 1)[..., 0], "L"), "PNG")
    la = gradient_noise(rng, 33, 41, 2)
    save("la.png", Image.fromarray(la, "LA"), "PNG")
    # 16-bit grayscale: PIL opens it as "I;16" and convert("RGB") clips values above 255.
    g16 = (rng.integers(0, 400, size=(20, 24))).astype(np.uint16)
    save("gray16.png", Image.fromarray(g16), "PNG")
    bits = (gradient_noise(rng, 24, 32, 1)[..., 0] > 127).astype(np.uint8) * 255
    save("bilevel.png", Image.fromarray(bits, "L").convert("1"), "PNG")
    pal = Image.fromarray(gradient_noise(rng, 40, 40, 3), "RGB").quantize(colors=13, method=Image.Quantize.MEDIANCUT)
    save("palette.png", pal, "PNG", transparency=3)

    photo = gradient_noise(rng, 48, 64, 3)
    save("photo.jpg", Image.fromarray(photo, "RGB"), "JPEG", quality=90)
    save("photo444.jpg", Image.fromarray(photo, "RGB"), "JPEG", quality=95, subsampling=0)
    save("progressive.jpg", Image.fromarray(photo, "RGB"), "JPEG", quality=85, progressive=True)
    save("gray.jpg", Image.fromarray(gradient_noise(rng, 31, 29, 1)[..., 0], "L"), "JPEG", quality=90)
    save("cmyk.jpg", Image.fromarray(gradient_noise(rng, 26, 34, 4), "CMYK"), "JPEG", quality=92)
    # Stored 40 wide x 24 high with EXIF orientation 6 (rotate 90 clockwise to display): the
    # decoded image is 24 wide x 40 high.
    save("exif_rot6.jpg", Image.fromarray(gradient_noise(rng, 24, 40, 3), "RGB"), "JPEG", quality=90,
         exif=exif_with_orientation(6))
    # The other orientations, on a tiny non-square image (7 wide, 5 high) so that each transpose
    # gives a distinct result.
    for orientation in (2, 3, 4, 5, 7, 8):
        save(f"exif_o{orientation}.png", Image.fromarray(gradient_noise(rng, 5, 7, 3), "RGB"), "PNG",
             exif=exif_with_orientation(orientation))

    save("lossless.webp", Image.fromarray(gradient_noise(rng, 30, 44, 4), "RGBA"), "WEBP", lossless=True)
    save("lossy.webp", Image.fromarray(gradient_noise(rng, 36, 28, 3), "RGB"), "WEBP", quality=80)

    # Two frames; the first covers only part of the screen, with a transparent index: PIL fills
    # the rest of the first frame with that index before converting through the palette.
    frame0 = Image.fromarray(gradient_noise(rng, 20, 30, 3), "RGB").quantize(colors=16)
    frame1 = Image.fromarray(gradient_noise(rng, 20, 30, 3), "RGB").quantize(colors=16)
    buf = io.BytesIO()
    frame0.save(buf, "GIF", save_all=True, append_images=[frame1], duration=100, loop=0,
                transparency=5, disposal=2)
    files["anim.gif"] = patch_gif_first_frame_extent(buf.getvalue())
    return files


def patch_gif_first_frame_extent(data):
    """Grows the logical screen of a GIF by 6x4 pixels so that its first frame, left at (0, 0),
    no longer covers it (PIL writes frames that fill the screen)."""
    data = bytearray(data)
    w = int.from_bytes(data[6:8], "little")
    h = int.from_bytes(data[8:10], "little")
    data[6:8] = (w + 6).to_bytes(2, "little")
    data[8:10] = (h + 4).to_bytes(2, "little")
    return bytes(data)


def load_like_transformers(data):
    image = Image.open(io.BytesIO(data))
    image = ImageOps.exif_transpose(image)
    return image.convert("RGB")


def make_processor():
    """The processor as the released processor_config.json configures it (shared/reference/ beside
    the repository); that file repeats the class defaults, which are used when it is absent."""
    if not PROCESSOR_CONFIG.exists():
        print(f"note: {PROCESSOR_CONFIG.name} not found beside the repository; class defaults")
        return Glm5NextImageProcessor()
    config = json.loads(PROCESSOR_CONFIG.read_text())["image_processor"]
    kwargs = {k: v for k, v in config.items() if k != "image_processor_type"}
    return Glm5NextImageProcessor(**kwargs)


class ResizeSpy:
    """Records the content size the reference asks the backend's resize for."""

    def __init__(self):
        self.calls = []
        self._orig = TorchvisionBackend.resize

    def __enter__(self):
        spy = self

        def wrapped(backend, image, size, *args, **kwargs):
            spy.calls.append((size.height, size.width))
            return spy._orig(backend, image, size, *args, **kwargs)

        TorchvisionBackend.resize = wrapped
        return self

    def __exit__(self, *exc):
        TorchvisionBackend.resize = self._orig


def reference_canvas(proc, chw, max_tokens):
    """The exact call `_preprocess` makes, on one image (uint8 [1, 3, H, W])."""
    return proc.resize(
        images=chw[None],
        resample=proc.resample,
        factor=proc.patch_size * proc.merge_size * proc.patch_expand_factor,
        temporal_factor=proc.temporal_patch_size,
        min_image_tokens=proc.min_image_tokens,
        max_image_tokens=max_tokens,
    )[0]


def processor_fixtures(proc, decoded):
    tensors, cases = {}, {}
    specs = [(name, None) for name in decoded]
    # Smaller budgets: downscales by about 1.07 (rgb_wide@20), 1.7 (photo444@2) and 5.4 (a one-token
    # canvas, rgb_wide@1); an upscale capped by the budget (photo@20); padding only (lossy@17).
    specs += [("photo.jpg", 20), ("rgb_wide.png", 20), ("lossy.webp", 17), ("rgb_wide.png", 1),
              ("photo444.jpg", 2)]
    for name, max_tokens in specs:
        case = name if max_tokens is None else f"{name}@max{max_tokens}"
        image = decoded[name]
        kwargs = {} if max_tokens is None else {"max_image_tokens": max_tokens}
        out = proc(images=[Image.fromarray(image)], return_tensors="pt", **kwargs)
        pixel_values = out["pixel_values"]
        assert pixel_values.dtype == torch.float32
        chw = torch.from_numpy(image).permute(2, 0, 1).contiguous()
        canvas = reference_canvas(proc, chw, max_tokens or proc.max_image_tokens)
        tensors[f"{case}.grid_thw"] = out["image_grid_thw"].to(torch.int64)
        if case in CANVAS_CASES:
            tensors[f"{case}.canvas"] = canvas.to(torch.float16).contiguous()
        tensors[f"{case}.row_sums"] = pixel_values.double().sum(dim=1)
        if case in FULL_PIXEL_CASES:
            tensors[f"{case}.pixel_values"] = pixel_values.contiguous()
        cases[case] = {"file": name, "max_image_tokens": max_tokens or proc.max_image_tokens}
    for case in FULL_PIXEL_CASES + CANVAS_CASES:
        assert case in cases, case
    return tensors, cases


def geometry_fixtures(proc):
    rng = np.random.default_rng(SEED + 1)
    sizes = [(700, 1000), (3000, 4000), (50, 60), (1080, 1920), (10, 5000), (224, 224), (111, 113),
             (1, 1), (28, 28), (112, 112), (111, 112), (5000, 10), (4000, 4000), (12544, 1), (2, 30000)]
    sizes += [(int(h), int(w)) for h, w in rng.integers(1, 2500, size=(25, 2))]
    out = []
    for h, w in sizes:
        for max_tokens in (proc.max_image_tokens, 64):
            canvas = smart_resize(num_frames=proc.temporal_patch_size, height=h, width=w,
                                  temporal_factor=proc.temporal_patch_size,
                                  factor=proc.patch_size * proc.merge_size,
                                  min_pixels=proc.min_image_tokens, max_pixels=max_tokens)
            with ResizeSpy() as spy:
                padded = proc.resize(images=torch.zeros((1, 3, h, w), dtype=torch.uint8),
                                     resample=proc.resample,
                                     factor=proc.patch_size * proc.merge_size,
                                     temporal_factor=proc.temporal_patch_size,
                                     min_image_tokens=proc.min_image_tokens,
                                     max_image_tokens=max_tokens)
            assert tuple(padded.shape[-2:]) == canvas
            content = spy.calls[0] if spy.calls else (h, w)
            patches = proc.get_number_of_image_patches(
                h, w, {"max_image_tokens": max_tokens}) if max_tokens != proc.max_image_tokens else \
                proc.get_number_of_image_patches(h, w)
            out.append({"height": h, "width": w, "max_image_tokens": max_tokens,
                        "canvas": list(canvas), "content": list(content), "patches": patches})
    return out


def token_fixtures():
    """Placeholder expansion and mm_token_type_ids with the reference processor's own methods,
    bound to a stand-in holding the ids the released tokenizer assigns."""
    ids = {"<|begin_of_image|>": 154830, "<|end_of_image|>": 154831, "<|begin_of_video|>": 154832,
           "<|end_of_video|>": 154833, "<|image|>": 154854, "<|video|>": 154855}
    grids = [[1, 8, 10], [1, 4, 4], [1, 50, 72]]
    stub = types.SimpleNamespace(image_token="<|image|>",
                                 image_processor=types.SimpleNamespace(merge_size=2))
    inputs = {"image_grid_thw": torch.tensor(grids)}
    expansions = [Glm5NextProcessor.replace_image_token(stub, inputs, i) for i in range(len(grids))]
    counts = [e.count("<|image|>") for e in expansions]
    assert all(len(e) == c * len("<|image|>") for e, c in zip(expansions, counts))

    # A token stream: text, image 0, text, a video of 2 tubelets (frames expand to image tokens),
    # text, image 1, text.
    def image_span(n):
        return [ids["<|begin_of_image|>"]] + [ids["<|image|>"]] * n + [ids["<|end_of_image|>"]]

    stream = [11, 12] + image_span(counts[0]) + [13] + [ids["<|begin_of_video|>"]]
    stream += image_span(3) + [50, 51] + image_span(3) + [52] + [ids["<|end_of_video|>"]]
    stream += [14] + image_span(counts[1]) + [15, ids["<|end_of_image|>"], 16]
    stub_ids = types.SimpleNamespace(image_token_id=ids["<|image|>"],
                                     video_start_id=ids["<|begin_of_video|>"],
                                     video_end_id=ids["<|end_of_video|>"])
    types_ = Glm5NextProcessor.create_mm_token_type_ids(stub_ids, [stream])[0]
    return {"token_ids": ids, "grids": grids, "image_token_counts": counts,
            "stream": stream, "mm_token_type_ids": [int(t) for t in types_]}


def tower_fixture():
    torch.manual_seed(SEED)
    config = Glm5NextVisionConfig(depth=2, hidden_size=32, num_heads=2, intermediate_size=64,
                                  out_hidden_size=64, projection_intermediate_size=96,
                                  image_size=112)
    config._attn_implementation = "eager"
    model = Glm5NextVisionModel(config).float().eval()
    gen = torch.Generator().manual_seed(SEED)
    params = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Every parameter is redrawn: constants (norm weights 1, biases 0) would leave code
            # paths untested. Norm weights stay near 1 so the activations keep a useful scale.
            if name.endswith("norm.weight") or name.endswith("norm1.weight") or \
               name.endswith("norm2.weight") or name.endswith("layernorm.weight"):
                value = 1.0 + 0.2 * torch.randn(p.shape, generator=gen)
            elif p.dim() == 1:
                value = 0.1 * torch.randn(p.shape, generator=gen)
            else:
                fan_in = p[0].numel()
                value = torch.randn(p.shape, generator=gen) / math.sqrt(fan_in)
            if name.endswith("mlp.gate_proj.weight") or name.endswith("merger.gate_proj.weight"):
                value = value * 6.0  # push some gate pre-activations past the clamp limit
            if name.endswith("mlp.up_proj.weight") or name.endswith("merger.up_proj.weight"):
                value = value * 6.0
            p.copy_(value)
            params["param.model.visual." + name] = value.clone().contiguous()
    grid = torch.tensor([[1, 4, 6], [1, 6, 2]], dtype=torch.int64)
    n = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum())
    pixel_values = torch.randn((n, 1176), generator=gen) * 1.2
    # Count how often the clamps bite, so a fixture that never exercises them is noticed.
    clamped = {"gate": 0, "up": 0}

    def hook(module, inputs, output):
        x = inputs[0]
        clamped["gate"] += int((module.gate_proj(x) > config.swiglu_limit).sum())
        up = module.up_proj(x)
        clamped["up"] += int((up.abs() > config.swiglu_limit).sum())

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if type(m).__name__ in ("Glm5NextVisionMLP", "Glm5NextVisionPatchMerger")]
    with torch.no_grad():
        out = model(pixel_values, grid_thw=grid)
    for h in handles:
        h.remove()
    assert clamped["gate"] > 0 and clamped["up"] > 0, clamped
    print("tower: clamped values", clamped)
    tensors = dict(params)
    tensors["pixel_values"] = pixel_values.contiguous()
    tensors["grid_thw"] = grid
    tensors["last_hidden_state"] = out.last_hidden_state.contiguous()
    tensors["pooler_output"] = out.pooler_output.contiguous()
    return tensors


def main():
    rng = np.random.default_rng(SEED)
    (OUT / "images").mkdir(parents=True, exist_ok=True)
    files = build_images(rng)
    decoded = {}
    for name, data in sorted(files.items()):
        (OUT / "images" / name).write_bytes(data)
        decoded[name] = np.array(load_like_transformers(data), dtype=np.uint8)
    total = sum(len(d) for d in files.values())
    print(f"images: {len(files)} files, {total} bytes")
    assert total < 200_000

    # uint8 data is stored as float16 (exact for 0..255): glmtune's safetensors reader has no U8.
    save_file({f"decode.{k}": torch.from_numpy(v).to(torch.float16) for k, v in decoded.items()},
              str(OUT / "decode.safetensors"))

    proc = make_processor()
    tensors, cases = processor_fixtures(proc, decoded)
    save_file(tensors, str(OUT / "processor.safetensors"), metadata={"cases": json.dumps(cases)})

    doc = {"geometry": geometry_fixtures(proc), "tokens": token_fixtures()}
    (OUT / "processor.json").write_text(json.dumps(doc, indent=1) + "\n")

    save_file(tower_fixture(), str(OUT / "tower.safetensors"))
    for f in sorted(OUT.glob("*.*")):
        print(f"{f.name}: {f.stat().st_size} bytes")


if __name__ == "__main__":
    main()
