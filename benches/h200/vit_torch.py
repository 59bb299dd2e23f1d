#!/usr/bin/env python3
"""PyTorch's fastest configurations of the vision encoder `vit_bench` times, as the peer for the
README's "Vision encoder" table (issue 21). Runs on the device machine (CUDA, PyTorch and
transformers installed, no network):

    python3 benches/h200/vit_torch.py [--batches 1,8,17] [--modes eager,sdpa,compile,max-autotune]
                                      [--iters 30] [--shape b16-512|tiny] [--device cuda|cpu]

The model is `vit_bench`'s `b16-512`: SmolVLM-256M's tower, SigLIP-B/16 at 512x512 (1024
patches, hidden 768, 12 layers, 12 heads, MLP 3072; transformers' `SiglipVisionModel`, random
weights), then SmolVLM's connector (pixel shuffle by 4, one linear layer to 576), in float16.
Modes:
- `eager`: transformers' eager attention (matmul, softmax, matmul);
- `sdpa`: `torch.nn.functional.scaled_dot_product_attention` (flash or memory-efficient kernels);
- `compile`: SDPA under `torch.compile`;
- `max-autotune`: SDPA under `torch.compile(mode="max-autotune")` (Inductor tunes its GEMMs and
  uses CUDA graphs), the strongest configuration a user would pick.

Each (mode, batch) runs `--warmup` untimed batches (compilation and autotuning happen there),
then `--iters` timed ones, each timed by CUDA events around one forward pass. One JSON object per
line: the median and minimum milliseconds per batch, milliseconds per image, images per second,
and TFLOP/s at the median (the same FLOP count `vit_bench` uses: GEMMs and attention products).
"""
import argparse
import json
import statistics
import sys
import time

import torch
from transformers import SiglipVisionConfig, SiglipVisionModel

SHAPES = {
    # image, patch, hidden, intermediate, layers, heads, scale factor, text hidden
    "b16-512": (512, 16, 768, 3072, 12, 12, 4, 576),
    "tiny": (128, 16, 192, 768, 4, 3, 2, 576),
}


class Encoder(torch.nn.Module):
    """The tower, then SmolVLM's connector (Idefics3's pixel shuffle and projection)."""

    def __init__(self, shape, attention):
        super().__init__()
        image, patch, hidden, inter, layers, heads, scale, text = SHAPES[shape]
        config = SiglipVisionConfig(
            image_size=image,
            patch_size=patch,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            layer_norm_eps=1e-6,
        )
        config._attn_implementation = attention
        # The transformer itself: `SiglipVisionModel.vision_model` in transformers 4.x; newer
        # releases (the device machine's) have no such attribute and are called alike.
        model = SiglipVisionModel(config)
        self.tower = getattr(model, "vision_model", model)
        self.scale = scale
        self.proj = torch.nn.Linear(hidden * scale * scale, text, bias=False)

    def forward(self, pixels):
        x = self.tower(pixel_values=pixels).last_hidden_state
        b, n, d = x.shape
        side = int(n**0.5)
        s = self.scale
        x = x.view(b, side, side // s, d * s)
        x = x.permute(0, 2, 1, 3).reshape(b, side // s, side // s, d * s * s)
        x = x.permute(0, 2, 1, 3).reshape(b, n // (s * s), d * s * s)
        return self.proj(x)


def flops_per_image(shape):
    """Multiply-adds x 2 of the GEMMs and the attention products, as vit_bench counts them."""
    image, patch, hidden, inter, layers, heads, scale, text = SHAPES[shape]
    n = (image // patch) ** 2
    per_layer = 2 * n * hidden * (4 * hidden + 2 * inter) + 2 * 2 * n * n * hidden
    embed = 2 * n * (3 * patch * patch) * hidden
    connector = 2 * (n // (scale * scale)) * hidden * scale * scale * text
    return layers * per_layer + embed + connector


def run(mode, batch, args):
    attention = "eager" if mode == "eager" else "sdpa"
    torch.manual_seed(0)
    model = Encoder(args.shape, attention).to(args.device, torch.float16).eval()
    if mode == "compile":
        model = torch.compile(model)
    elif mode == "max-autotune":
        model = torch.compile(model, mode="max-autotune")
    image = SHAPES[args.shape][0]
    pixels = torch.randn(batch, 3, image, image, device=args.device, dtype=torch.float16)
    cuda = args.device == "cuda"
    t0 = time.perf_counter()
    with torch.inference_mode():
        for _ in range(args.warmup):
            model(pixels)
        if cuda:
            torch.cuda.synchronize()
        warm_s = time.perf_counter() - t0
        times = []
        for _ in range(args.iters):
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                model(pixels)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                model(pixels)
                times.append((time.perf_counter() - t) * 1e3)
    median = statistics.median(times)
    return {
        "engine": "pytorch",
        "torch": torch.__version__,
        "mode": mode,
        "shape": args.shape,
        "batch": batch,
        "dtype": "float16",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "iters": args.iters,
        "ms_per_batch_median": round(median, 4),
        "ms_per_batch_min": round(min(times), 4),
        "ms_per_image": round(median / batch, 4),
        "images_per_s": round(1e3 * batch / median, 1),
        "tflops": round(flops_per_image(args.shape) * batch / (median * 1e-3) / 1e12, 1),
        "warmup_s": round(warm_s, 1),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,8,17")
    p.add_argument("--modes", default="eager,sdpa,compile,max-autotune")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--shape", default="b16-512", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    if args.iters < 1 or args.warmup < 1:
        sys.exit("--iters and --warmup take at least 1")
    for mode in args.modes.split(","):
        if mode not in ("eager", "sdpa", "compile", "max-autotune"):
            sys.exit(f"unknown mode {mode!r}: eager, sdpa, compile or max-autotune")
        for batch in (int(b) for b in args.batches.split(",")):
            try:
                print(json.dumps(run(mode, batch, args)), flush=True)
            except Exception as e:  # one configuration failing must not hide the others
                print(json.dumps({"mode": mode, "batch": batch, "error": repr(e)}), flush=True)
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
