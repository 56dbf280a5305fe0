#!/usr/bin/env python3
"""Rebuilds examples/tiny-vl/media/ from the Debian package python3-imageio (2.4.1-5), whose
resources/images/ hold the source files (see README.md for their origin and license).

Usage: apt-get download python3-imageio && dpkg -x python3-imageio_*.deb deb
       python3 examples/tiny-vl/make_media.py deb/usr/lib/python3/dist-packages/imageio/resources/images
Needs Pillow and PyAV. The outputs are small on purpose: thumbnails and a 3-second 160x90 clip.
"""

import fractions
import sys
from pathlib import Path

import av
from PIL import Image

OUT = Path(__file__).resolve().parent / "media"


def main(src):
    src = Path(src)
    OUT.mkdir(exist_ok=True)
    Image.open(src / "astronaut.png").convert("RGB").resize((128, 128), Image.LANCZOS).save(
        OUT / "astronaut.jpg", quality=85)
    Image.open(src / "chelsea.png").convert("RGB").resize((150, 100), Image.LANCZOS).save(
        OUT / "chelsea.jpg", quality=85)
    cradle = Image.open(src / "newtonscradle.gif")
    cradle.seek(0)
    cradle.convert("RGB").resize((120, 90), Image.LANCZOS).save(OUT / "newtonscradle.png")

    # The first 3 seconds of the cockatoo clip at 10 frames per second, 160x90, H.264.
    inp = av.open(str(src / "cockatoo.mp4"))
    out = av.open(str(OUT / "cockatoo.mp4"), "w")
    stream = out.add_stream("libx264", rate=fractions.Fraction(10))
    stream.width, stream.height, stream.pix_fmt = 160, 90, "yuv420p"
    stream.options = {"crf": "30", "preset": "slow", "threads": "1"}
    source = inp.streams.video[0]
    step = round(float(source.average_rate) / 10)
    for i, frame in enumerate(inp.decode(source)):
        if i >= 3 * 10 * step:
            break
        if i % step:
            continue
        image = frame.to_image().resize((160, 90), Image.LANCZOS)
        for packet in stream.encode(av.VideoFrame.from_image(image)):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)
    out.close()


if __name__ == "__main__":
    main(sys.argv[1])
