#!/usr/bin/env python3
"""Golden fixtures for video decoding, the video processor and media geometry (transformers 5.17.0).

Needs, besides transformers 5.17.0 and torch: torchvision (the video processor's backend), torchcodec
(what transformers decodes video files with; it loads the system's FFmpeg shared libraries, on
Debian 12 libavdevice59 and friends) and PyAV (only to write the test videos). Install them next to
the reference stack with `pip install --no-deps torchvision torchcodec av`.

Writes, under tests/golden/media_video/:
  videos/*        tiny test videos written here with PyAV: H.264/MP4, VP9/WebM, VP8/WebM, MPEG-4/AVI,
                  FFV1/MKV (4:4:4), MJPEG/MOV (full range 4:2:2); several frame rates (7.5 to 30,
                  29.97) and lengths (0.7 to 12.5 s), frame widths that are and are not multiples
                  of 32 (torchcodec converts those through different FFmpeg paths).
  video.safetensors
                  For each video <v>, as `Glm5NextProcessor` processes it from its path:
                    <v>.frame_sums i64 [F, 2]: per sampled decoded frame (uint8 RGB), the sum of its
                      bytes and the sum of byte · (position % 251 + 1);
                    <v>.row_sums f64 [N] and <v>.row_wsums f64 [N]: per row of pixel_values_videos,
                      the sum and the sum of value · (element % 97 + 1);
                    <v>.rows_head f32 [2, 1176]: the first two rows.
                  Metadata "golden" (JSON):
                    videos: v -> {num_frames, fps, duration, width, height, frame_indices,
                      timestamps, video_grid_thw, input_ids, mm_token_type_ids} where the ids are
                      the processor's for PROMPT (one video) with the tiny tokenizer
                      (examples/tiny/tokenizer);
                    sampling: the reference `sample_frames` for synthetic metadata, with and without
                      a duration, and with other fps / max_frames / max_duration settings;
                    video_geometry: (frames, height, width) -> canvas, content size, grid;
                    image_geometry: (height, width) -> canvas, content size, grid for many sizes
                      (tiny, huge, extreme aspect ratios, just inside and outside the budget).

Usage: python tools/golden/media_video.py
"""

import fractions
import json
import math
from pathlib import Path

import av
import numpy as np
import torch
from safetensors.torch import save_file

import transformers
from transformers import AutoTokenizer
from transformers.models.glm5_next.image_processing_glm5_next import Glm5NextImageProcessor, smart_resize
from transformers.models.glm5_next.processing_glm5_next import Glm5NextProcessor
from transformers.models.glm5_next.video_processing_glm5_next import Glm5NextVideoProcessor
from transformers.video_utils import VideoMetadata

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "golden" / "media_video"
TOKENIZER = REPO / "examples" / "tiny" / "tokenizer"
PROMPT = "<|user|>Watch: <|begin_of_video|><|video|><|end_of_video|>What moves?<|assistant|>"

assert transformers.__version__ == "5.17.0", transformers.__version__

# name, codec, frame rate, frames, width, height, pixel format, container format
VIDEOS = [
    ("h264_30fps.mp4", "libx264", fractions.Fraction(30), 75, 64, 48, "yuv420p", "mp4"),
    ("vp9_25fps.webm", "libvpx-vp9", fractions.Fraction(25), 33, 70, 38, "yuv420p", "webm"),
    ("vp8_2997fps.webm", "libvpx", fractions.Fraction(30000, 1001), 50, 50, 50, "yuv420p", "webm"),
    ("mpeg4_10fps.avi", "mpeg4", fractions.Fraction(10), 47, 96, 54, "yuv420p", "avi"),
    ("ffv1_24fps.mkv", "ffv1", fractions.Fraction(24), 17, 24, 18, "yuv444p", "matroska"),
    ("mjpeg_7.5fps.mov", "mjpeg", fractions.Fraction(15, 2), 20, 36, 52, "yuvj422p", "mov"),
    ("h264_12fps_long.mp4", "libx264", fractions.Fraction(12), 150, 32, 32, "yuv420p", "mp4"),
]


def frame_pixels(rng, i, n, w, h):
    """Smooth moving ramps plus mild noise: compresses to a few KB yet every frame differs."""
    y = np.linspace(0.0, 1.0, h)[:, None, None]
    x = np.linspace(0.0, 1.0, w)[None, :, None]
    phase = np.arange(3)[None, None, :] / 3 + i / n
    base = 127.5 + 100.0 * np.sin(2 * math.pi * (x * 1.3 + y * 0.7 + phase))
    return np.clip(np.rint(base + rng.normal(0.0, 6.0, size=(h, w, 3))), 0, 255).astype(np.uint8)


def write_video(path, codec, rate, n, w, h, pix_fmt, fmt, seed):
    rng = np.random.default_rng(seed)
    container = av.open(str(path), "w", format=fmt)
    stream = container.add_stream(codec, rate=rate)
    stream.width, stream.height, stream.pix_fmt = w, h, pix_fmt
    if codec == "libx264":
        # Deterministic output across runs: no threads, a fixed preset.
        stream.options = {"preset": "medium", "crf": "30", "threads": "1"}
    elif codec.startswith("libvpx"):
        stream.options = {"crf": "40", "b": "0", "threads": "1", "deadline": "good"}
    elif codec == "mpeg4" or codec == "mjpeg":
        stream.options = {"qscale": "8"}
    for i in range(n):
        frame = av.VideoFrame.from_ndarray(frame_pixels(rng, i, n, w, h), format="rgb24")
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)
    container.close()


def weighted(values, modulus):
    flat = values.reshape(values.shape[0], -1).to(torch.float64)
    weights = (torch.arange(flat.shape[1], dtype=torch.float64) % modulus) + 1
    return flat.sum(dim=1), (flat * weights).sum(dim=1)


def video_cases(processor, video_processor):
    tensors, meta = {}, {}
    videos_dir = OUT / "videos"
    videos_dir.mkdir(parents=True, exist_ok=True)
    for seed, (name, codec, rate, n, w, h, pix_fmt, fmt) in enumerate(VIDEOS):
        path = videos_dir / name
        write_video(path, codec, rate, n, w, h, pix_fmt, fmt, seed)
        # The decoded frames and metadata, as the processor fetches them.
        frames, metadata = video_processor.fetch_videos(
            str(path), sample_indices_fn=lambda metadata, **kw: video_processor.sample_frames(metadata))
        frames = torch.as_tensor(frames)  # [F, 3, H, W] uint8
        hwc = frames.permute(0, 2, 3, 1).contiguous()
        sums, _ = weighted(hwc, 1)
        positions = torch.arange(hwc[0].numel(), dtype=torch.int64) % 251 + 1
        wsums = (hwc.reshape(hwc.shape[0], -1).to(torch.int64) * positions).sum(dim=1)
        tensors[f"{name}.frame_sums"] = torch.stack([sums.to(torch.int64), wsums], dim=1)

        out = processor(text=[PROMPT], videos=[str(path)], return_tensors="pt")
        pixels = out["pixel_values_videos"].to(torch.float32)
        row_sums, row_wsums = weighted(pixels, 97)
        tensors[f"{name}.row_sums"] = row_sums
        tensors[f"{name}.row_wsums"] = row_wsums
        tensors[f"{name}.rows_head"] = pixels[:2].contiguous()
        meta[name] = {
            "num_frames": int(metadata.total_num_frames),
            "fps": float(metadata.fps),
            "duration": float(metadata.duration),
            "width": int(metadata.width),
            "height": int(metadata.height),
            "frame_indices": [int(i) for i in metadata.frames_indices],
            "timestamps": [float(t) for t in metadata.timestamps],
            "video_grid_thw": out["video_grid_thw"][0].tolist(),
            "input_ids": out["input_ids"][0].tolist(),
            "mm_token_type_ids": out["mm_token_type_ids"][0].tolist(),
        }
    return tensors, meta


def sampling_cases():
    """The reference sampler on metadata alone (decoders always give a duration; frames passed as
    arrays with metadata may not)."""
    cases = []
    for total, fps, duration in [
        (300, 30.0, 10.0), (300, 30.0, None), (90, 30.0, 3.0), (33, 25.0, 1.32), (17, 24.0, 17 / 24),
        (11, 24.0, 11 / 24), (47, 10.0, 4.7), (150, 12.0, 12.5), (20, 7.5, 20 / 7.5), (1, 30.0, None),
        (5, 1.0, 5.0), (3, 0.5, 6.0), (1000, 29.97002997002997, 1000 / 29.97002997002997),
        (7201, 60.0, None), (250, 25.0, 10.04), (64, 2.0, 32.0), (2, 30.0, 0.0667),
    ]:
        for settings in [{}, {"fps": 1}, {"fps": 5, "max_frames": 8}, {"max_duration": 3}]:
            vp = Glm5NextVideoProcessor(**{k: v for k, v in settings.items() if k != "fps"})
            metadata = VideoMetadata(total_num_frames=total, fps=fps, duration=duration)
            try:
                indices = vp.sample_frames(metadata, fps=settings.get("fps")).tolist()
            except Exception as e:  # recorded as such: the C++ side must fail too
                indices = f"error: {type(e).__name__}"
            cases.append({"total_frames": total, "fps": fps, "duration": duration or 0.0,
                          "settings": settings, "indices": indices})
    return cases


def content_size(frames, height, width, th, tw, factor=28, temporal=2, min_tokens=16):
    scale = min(th / height, tw / width)
    if frames * height * width >= temporal * factor**2 * min_tokens:
        scale = min(1.0, scale)
    return (max(1, min(th, math.floor(height * scale))), max(1, min(tw, math.floor(width * scale))))


def geometry_cases():
    video = []
    for frames, height, width in [
        (20, 1080, 1920), (2, 48, 64), (6, 48, 64), (5, 38, 70), (2048, 1080, 1920), (64, 720, 1280),
        (300, 2160, 3840), (2, 10, 10), (4, 10, 4000), (12, 4000, 10), (2, 1, 1), (120, 480, 640),
        (7, 333, 517), (2048, 28, 28), (2, 5000, 5000),
    ]:
        th, tw = smart_resize(num_frames=frames, height=height, width=width, temporal_factor=2,
                              factor=28, min_pixels=16, max_pixels=240000)
        ch, cw = content_size(frames, height, width, th, tw)
        video.append({"frames": frames, "height": height, "width": width, "canvas": [th, tw],
                      "content": [ch, cw], "grid": [(frames + 1) // 2, th // 14, tw // 14]})
    image = []
    ip = Glm5NextImageProcessor()
    sizes = [(1, 1), (1, 10000), (10000, 1), (2, 3), (28, 28), (111, 113), (112, 112), (113, 111),
             (224, 224), (2500, 2508), (2504, 2504), (2520, 2520), (2800, 2800), (3000, 4000),
             (4000, 3000), (8000, 8000), (20000, 30), (30, 20000), (10, 5000), (5000, 10),
             (700, 1000), (1080, 1920), (2156, 2884), (2157, 2884), (2500, 2500), (2464, 2548),
             (79, 159), (80, 160), (12544, 1), (1, 12544), (100, 125), (99, 127), (3583, 3583)]
    for height, width in sizes:
        th, tw = smart_resize(num_frames=2, height=height, width=width, temporal_factor=2,
                              factor=28, min_pixels=ip.min_image_tokens, max_pixels=ip.max_image_tokens)
        ch, cw = content_size(2, height, width, th, tw)
        patches = ip.get_number_of_image_patches(height, width, {})
        image.append({"height": height, "width": width, "canvas": [th, tw], "content": [ch, cw],
                      "patches": int(patches)})
    return video, image


def main():
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    image_processor = Glm5NextImageProcessor()
    video_processor = Glm5NextVideoProcessor()
    processor = Glm5NextProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                  video_processor=video_processor)
    tensors, videos = video_cases(processor, video_processor)
    video_geometry, image_geometry = geometry_cases()
    golden = {"prompt": PROMPT, "videos": videos, "sampling": sampling_cases(),
              "video_geometry": video_geometry, "image_geometry": image_geometry}
    out = OUT / "video.safetensors"
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(out),
              metadata={"golden": json.dumps(golden, sort_keys=True)})
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {out.relative_to(REPO)} and {len(VIDEOS)} videos, {total} bytes in all")
    assert total < 200_000, total


if __name__ == "__main__":
    main()
