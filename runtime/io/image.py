"""Image inputs for ``tessera run`` (ViT): files -> a normalised pixels batch.

Preprocessing follows Hugging Face's ViTImageProcessor with its defaults:
convert to RGB (or to grayscale for a one-channel model), resize to the
model's image size with Pillow's bilinear filter, rescale by 1/255, then
normalise each channel with mean 0.5 and standard deviation 0.5, so values
lie in [-1, 1]; the result is laid out [N, C, H, W]. Reading images needs
Pillow (the ``image`` extra: ``pip install 'tessera[image]'``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tessera.compiler.ir.graph import DTYPES
from tessera.compiler.ir.signature import InputError, InputSpec

MEAN = 0.5
STD = 0.5


def pixels_spec(specs: list[InputSpec]) -> InputSpec:
    """The image input: the one named 'pixels', else the model's only rank-4 floating-point input."""
    by_name = {s.name: s for s in specs}
    spec = by_name.get("pixels")
    if spec is None:
        cands = [s for s in specs if len(s.dims) == 4 and s.dtype in ("f32", "f16", "bf16")]
        if len(cands) != 1:
            raise InputError("--image fills an input 'pixels' of shape [B, C, H, W], but the model's inputs are: "
                             + ", ".join(f"{s.name}: {s}" for s in specs) + "; give them with --input")
        spec = cands[0]
    if len(spec.dims) != 4 or not all(isinstance(d, int) for d in spec.dims[1:]):
        raise InputError(f"--image needs input '{spec.name}' to be [B, C, H, W] with fixed C, H and W, got {spec}")
    if spec.dims[1] not in (1, 3):
        raise InputError(f"--image reads RGB or grayscale images, but input '{spec.name}' has {spec.dims[1]} "
                         f"channels ({spec})")
    return spec


# A decompression bomb guard: a photo for a classifier is far below this (8K is 33 megapixels).
MAX_PIXELS = 64 * 1024 * 1024


def load_image(path: str | Path, height: int, width: int, channels: int = 3) -> np.ndarray:
    """One image as f32 [C, H, W], resized and normalised as ViTImageProcessor does."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise InputError("--image needs Pillow: pip install 'tessera[image]'") from None
    path = Path(path)
    if not path.is_file():
        raise InputError(f"image file not found: {path}")
    try:
        with Image.open(path) as im:  # reads the header only: the size is known before decoding
            if im.width * im.height > MAX_PIXELS:
                raise InputError(f"{path} is {im.width}×{im.height} pixels; images are at most "
                                 f"{MAX_PIXELS:,} pixels (it is resized to {width}×{height} anyway)")
            im = im.convert("RGB" if channels == 3 else "L")
            im = im.resize((width, height), resample=Image.Resampling.BILINEAR)
            arr = np.asarray(im, dtype=np.uint8)
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise InputError(f"cannot read {path} as an image: {e}") from None
    x = (arr.astype(np.float64) * (1 / 255)).astype(np.float32)
    x = (x - np.float32(MEAN)) / np.float32(STD)
    return x[None] if x.ndim == 2 else np.transpose(x, (2, 0, 1))


def image_feeds(paths: list[str], specs: list[InputSpec]) -> dict[str, np.ndarray]:
    """{pixels input name: [N, C, H, W] batch} for the image files given."""
    spec = pixels_spec(specs)
    _, c, h, w = spec.dims
    batch = np.stack([load_image(p, h, w, c) for p in paths])
    return {spec.name: batch.astype(DTYPES[spec.dtype])}
