"""`glmtune preprocess` against transformers 5.17.0 `Glm5NextProcessor`.

For each conversation, the reference renders the chat template (examples/tiny/tokenizer's
chat_template.jinja, the released one) and runs the processor on the text with the images loaded as
transformers loads them and the videos given by path (decoded with torchcodec, as transformers
does). glmtune must give identical input_ids (its training sequence adds only the trained final
`<|endoftext|>`), mm_token_type_ids, image_grid_thw and video_grid_thw, and pixel_values /
pixel_values_videos within 1e-6.

Cases: the bundled tiny VL example (real photos and a real H.264 clip), the video fixtures of
tests/golden/media_video (several codecs, containers, frame rates and lengths), and images of
extreme sizes and aspect ratios written here, run once with the released budget and once with a
small max_image_tokens so that sizes just inside and just outside the budget stay cheap.

Needs torchvision and torchcodec next to the reference stack (skipped, exit 77, without them).
Run through tests/reference/run.sh (ctest label `reference`); needs GLMTUNE_BIN.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import torch
from safetensors import safe_open

try:
    import torchcodec  # noqa: F401  (the reference's video decoder)
    import torchvision  # noqa: F401  (the processors' backend)
    from PIL import Image
except ImportError as e:
    print(f"skipped: {e.name} is missing (pip install --no-deps torchvision torchcodec pillow)")
    sys.exit(77)

from transformers import AutoTokenizer
from transformers.image_utils import load_image
from transformers.models.glm5_next.image_processing_glm5_next import Glm5NextImageProcessor
from transformers.models.glm5_next.processing_glm5_next import Glm5NextProcessor
from transformers.models.glm5_next.video_processing_glm5_next import Glm5NextVideoProcessor

BIN = os.environ.get("GLMTUNE_BIN", "glmtune")
SOURCE = os.environ.get("GLMTUNE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
TOKENIZER = os.path.join(SOURCE, "examples", "tiny", "tokenizer")
EXAMPLE = os.path.join(SOURCE, "examples", "tiny-vl")
VIDEOS = os.path.join(SOURCE, "tests", "golden", "media_video", "videos")


def media_items(messages):
    for m in messages:
        if isinstance(m.get("content"), list):
            for item in m["content"]:
                if isinstance(item, dict) and item.get("type") in ("image", "video"):
                    yield item["type"], item[item["type"]]


class PreprocessParity(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="glmtune-preprocess-")
        cls.tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
        with open(os.path.join(TOKENIZER, "chat_template.jinja")) as f:
            cls.template = f.read()

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def processor_dir(self, max_image_tokens):
        """A copy of the tiny processor folder with another image budget."""
        path = os.path.join(self.tmp, f"processor-{max_image_tokens}")
        if not os.path.isdir(path):
            shutil.copytree(TOKENIZER, path)
            with open(os.path.join(path, "processor_config.json")) as f:
                config = json.load(f)
            config["image_processor"]["max_image_tokens"] = max_image_tokens
            with open(os.path.join(path, "processor_config.json"), "w") as f:
                json.dump(config, f)
        return path

    def check(self, messages, media_root, processor_dir=TOKENIZER):
        with open(os.path.join(processor_dir, "processor_config.json")) as f:
            config = json.load(f)
        messages_file = os.path.join(self.tmp, "messages.json")
        pixels_file = os.path.join(self.tmp, "pixels.safetensors")
        with open(messages_file, "w") as f:
            json.dump({"messages": messages}, f)
        run = subprocess.run([BIN, "preprocess", "--processor", processor_dir, "--messages",
                              messages_file, "--media-root", media_root, "--pixels", pixels_file],
                             capture_output=True, text=True)
        self.assertEqual(run.returncode, 0, run.stderr)
        ours = json.loads(run.stdout)

        processor = Glm5NextProcessor(
            image_processor=Glm5NextImageProcessor(**config["image_processor"]),
            tokenizer=self.tokenizer,
            video_processor=Glm5NextVideoProcessor(**config["video_processor"]))
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=self.template)
        items = list(media_items(messages))
        images = [load_image(os.path.join(media_root, p)) for kind, p in items if kind == "image"]
        videos = [os.path.join(media_root, p) for kind, p in items if kind == "video"]
        ref = processor(text=[text], images=images or None, videos=videos or None, return_tensors="pt")

        ids = ours["input_ids"]
        end = self.tokenizer.convert_tokens_to_ids("<|endoftext|>")
        if messages[-1]["role"] == "assistant":
            self.assertEqual(ids[-1], end)
            self.assertEqual(ours["loss_mask"][-1], 1)
            ids = ids[:-1]
            ours["mm_token_type_ids"] = ours["mm_token_type_ids"][:-1]
        self.assertEqual(ids, ref["input_ids"][0].tolist())
        self.assertEqual(ours["mm_token_type_ids"], ref["mm_token_type_ids"][0].tolist())
        with safe_open(pixels_file, "pt") as f:
            for pixels, grid in (("pixel_values", "image_grid_thw"),
                                 ("pixel_values_videos", "video_grid_thw")):
                want_grid = ref[grid].tolist() if grid in ref else []
                self.assertEqual(ours[grid], want_grid)
                got = f.get_tensor(pixels)
                if pixels not in ref:
                    self.assertEqual(got.shape[0], 0)
                    continue
                want = ref[pixels].to(torch.float32)
                self.assertEqual(tuple(got.shape), tuple(want.shape))
                self.assertLessEqual((got - want).abs().max().item(), 1e-6, pixels)

    def test_bundled_example(self):
        with open(os.path.join(EXAMPLE, "chat.jsonl")) as f:
            chats = [json.loads(line) for line in f if line.strip()]
        self.assertGreaterEqual(len(chats), 4)
        for i, chat in enumerate(chats):
            with self.subTest(line=i + 1):
                self.check(chat["messages"], EXAMPLE)

    def test_videos_of_many_codecs_and_rates(self):
        names = sorted(os.listdir(VIDEOS))
        self.assertGreaterEqual(len(names), 7)
        for name in names:
            with self.subTest(video=name):
                messages = [{"role": "user", "content": [
                    {"type": "video", "video": name}, {"type": "text", "text": "What happens?"}]},
                    {"role": "assistant", "content": "Colours drift."}]
                self.check(messages, VIDEOS)

    def test_images_of_extreme_sizes(self):
        rng = np.random.default_rng(7)
        # (height, width, max_image_tokens): tiny, thin, upscaled, padded, downscaled, and sizes
        # just inside / just outside a budget of 300 merged tokens (canvas 420x560 is exactly 300).
        cases = [(1, 1, 8000), (3, 700, 8000), (700, 3, 8000), (111, 113, 8000), (50, 60, 8000),
                 (10, 5000, 8000), (2600, 60, 8000), (420, 560, 300), (421, 560, 300),
                 (420, 561, 300), (448, 532, 300), (1000, 1000, 300), (4000, 30, 300)]
        for h, w, budget in cases:
            with self.subTest(size=f"{h}x{w}", budget=budget):
                name = f"img_{h}x{w}.png"
                pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
                Image.fromarray(pixels, "RGB").save(os.path.join(self.tmp, name))
                messages = [{"role": "user", "content": [
                    {"type": "image", "image": name}, {"type": "text", "text": "Size?"}]}]
                self.check(messages, self.tmp, self.processor_dir(budget))


if __name__ == "__main__":
    unittest.main()
