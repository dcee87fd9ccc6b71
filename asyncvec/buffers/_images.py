"""Per-sample compression of image observations (uint8 ``[H, W]`` / ``[H, W, C]`` Box leaves).

Each stored image becomes one self-describing ``bytes`` blob whose first byte names its format:

* ``0`` raw: the image's bytes as they are (used whenever a codec would not make it smaller,
  so a blob is never longer than the image plus one byte);
* ``1`` ``"zlib"`` (lossless, the default): the PNG "up" filter (each row minus the row above,
  mod 256) and then ``zlib`` at ``level``: numpy and the standard library only;
* ``2`` ``"quantize"`` (lossy, numpy only): the top ``bits`` bits of every value, filtered and
  zlib-compressed like ``"zlib"``; decoded values are the centres of the quantization steps
  (error at most ``2 ** (8 - bits) / 2``);
* ``3`` ``"jpeg"`` (lossy): JPEG at ``quality`` through Pillow (an optional dependency,
  imported only when this codec is used); 1- or 3-channel images only.

Decoding reads the tag, so a buffer can hold blobs of several formats.
"""

from __future__ import annotations

import io
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium import spaces

__all__ = ["ImageCompression", "is_image_space", "resolve_image_compression"]

RAW, ZLIB, QUANTIZE, JPEG = 0, 1, 2, 3
METHODS = {"zlib": ZLIB, "quantize": QUANTIZE, "jpeg": JPEG}
#: an image leaf has at least this many pixels (smaller uint8 arrays are not worth a blob)
MIN_PIXELS = 64


def is_image_space(space: spaces.Space[Any]) -> bool:
    """Whether a leaf space is stored as an image when compression is on: a uint8 ``Box`` of
    shape ``(H, W)`` or ``(H, W, C)`` with ``C`` in 1, 3, 4 and at least 64 pixels.

    Example:
        >>> is_image_space(spaces.Box(0, 255, (64, 64, 3), np.uint8)), is_image_space(spaces.Box(0, 1, (4,)))
        (True, False)
    """
    if not isinstance(space, spaces.Box) or space.dtype != np.uint8:
        return False
    shape = space.shape
    if len(shape) == 3 and shape[2] not in (1, 3, 4):
        return False
    return len(shape) in (2, 3) and shape[0] * shape[1] >= MIN_PIXELS


@dataclass(frozen=True)
class ImageCompression:
    """How image leaves are compressed in a buffer.

    Args:
        method: ``"zlib"`` (lossless), ``"quantize"`` or ``"jpeg"`` (lossy).
        level: zlib level 1 (fast) .. 9 (small), for ``"zlib"`` and ``"quantize"``.
        bits: bits kept per value by ``"quantize"`` (1..7).
        quality: JPEG quality 1..95 for ``"jpeg"``.

    Example:
        >>> codec = ImageCompression("zlib")
        >>> images = np.zeros((2, 16, 16, 3), np.uint8); images[:, 4:8] = 200
        >>> blobs = codec.compress(images)
        >>> [len(b) < images[0].nbytes for b in blobs], np.array_equal(codec.decompress(blobs, (16, 16, 3)), images)
        ([True, True], True)
    """

    method: str = "zlib"
    level: int = 1
    bits: int = 5
    quality: int = 90

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"image_compression: method must be one of {sorted(METHODS)}, got {self.method!r}")
        if isinstance(self.level, bool) or not isinstance(self.level, int) or not 1 <= self.level <= 9:
            raise ValueError(f"image_compression: level must be an int in 1..9, got {self.level!r}")
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 7:
            raise ValueError(f"image_compression: bits must be an int in 1..7, got {self.bits!r}")
        if isinstance(self.quality, bool) or not isinstance(self.quality, int) or not 1 <= self.quality <= 95:
            raise ValueError(f"image_compression: quality must be an int in 1..95, got {self.quality!r}")
        if self.method == "jpeg":
            _pillow()  # fail at construction, not at the first add

    @property
    def lossless(self) -> bool:
        """Whether decoding gives back exactly the stored image."""
        return self.method == "zlib"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly form (stored in a buffer's ``meta.json``)."""
        return {"method": self.method, "level": self.level, "bits": self.bits, "quality": self.quality}

    # -- encoding ---------------------------------------------------------------------
    def compress(self, images: np.ndarray) -> np.ndarray:
        """One blob per image of a uint8 batch ``[n, H, W(, C)]``: an object array ``(n,)``."""
        n = images.shape[0]
        blobs = np.empty(n, dtype=object)
        raw_size = images[0].nbytes if n else 0
        if self.method == "jpeg":
            for i in range(n):
                blobs[i] = _smaller(_encode_jpeg(images[i], self.quality), images[i], raw_size)
            return blobs
        tag, values = ZLIB, images
        if self.method == "quantize":
            tag, values = QUANTIZE, images >> (8 - self.bits)
        filtered = _up_filter(values)
        header = bytes((tag,)) if tag == ZLIB else bytes((tag, self.bits))
        for i in range(n):
            blobs[i] = _smaller(header + zlib.compress(filtered[i].tobytes(), self.level), images[i], raw_size)
        return blobs

    @staticmethod
    def decompress(blobs: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """Images ``[*blobs.shape, *shape]`` (uint8) from blobs of any format; an empty slot
        (not a non-empty ``bytes``) decodes to zeros."""
        flat = np.asarray(blobs, dtype=object).reshape(-1)
        out = np.zeros((flat.size, *shape), np.uint8)
        filtered: list[int] = []
        quantized: dict[int, list[int]] = {}
        for i, blob in enumerate(flat):
            if not isinstance(blob, bytes) or not blob:
                continue
            tag = blob[0]
            if tag == RAW:
                out[i] = np.frombuffer(blob, np.uint8, offset=1).reshape(shape)
            elif tag == ZLIB:
                out[i] = np.frombuffer(zlib.decompress(blob[1:]), np.uint8).reshape(shape)
                filtered.append(i)
            elif tag == QUANTIZE:
                out[i] = np.frombuffer(zlib.decompress(blob[2:]), np.uint8).reshape(shape)
                quantized.setdefault(blob[1], []).append(i)
            elif tag == JPEG:
                out[i] = _decode_jpeg(blob[1:], shape)
            else:
                raise ValueError(f"image blob {i}: unknown format tag {tag}")
        if filtered:
            rows = np.asarray(filtered)
            out[rows] = np.cumsum(out[rows], axis=1, dtype=np.uint8)  # undo the up filter (mod 256)
        for bits, indices in quantized.items():
            rows = np.asarray(indices)
            steps = np.cumsum(out[rows], axis=1, dtype=np.uint8)
            out[rows] = (steps << (8 - bits)) + np.uint8((1 << (8 - bits)) // 2)  # step centres
        return out.reshape(*np.shape(blobs), *shape)


def resolve_image_compression(spec: Any) -> ImageCompression | None:
    """``None``/``False`` (off), ``True`` (lossless zlib), a method name or an `ImageCompression`.

    Example:
        >>> resolve_image_compression(True).method, resolve_image_compression("jpeg").lossless
        ('zlib', False)
    """
    if spec is None or spec is False:
        return None
    if spec is True:
        return ImageCompression()
    if isinstance(spec, ImageCompression):
        return spec
    if isinstance(spec, str):
        return ImageCompression(spec)
    if isinstance(spec, dict):
        return ImageCompression(**spec)
    raise TypeError(
        f"image_compression: expected None, True, one of {sorted(METHODS)} or an ImageCompression, got {spec!r}"
    )


def _up_filter(values: np.ndarray) -> np.ndarray:
    """PNG's "up" filter over axis 1 (image rows) of a batch, mod 256."""
    filtered: np.ndarray = values.copy()
    np.subtract(values[:, 1:], values[:, :-1], out=filtered[:, 1:])
    return filtered


def _smaller(blob: bytes, image: np.ndarray, raw_size: int) -> bytes:
    return blob if len(blob) < raw_size + 1 else bytes((RAW,)) + image.tobytes()


def _pillow() -> Any:
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - Pillow is installed with matplotlib
        raise ImportError("image_compression='jpeg' needs Pillow (pip install pillow); 'zlib' needs nothing") from exc
    return Image


def _encode_jpeg(image: np.ndarray, quality: int) -> bytes:
    if image.ndim == 3 and image.shape[2] not in (1, 3):
        raise ValueError(f"image_compression='jpeg' takes 1- or 3-channel images, got shape {image.shape}")
    pixels = image[..., 0] if image.ndim == 3 and image.shape[2] == 1 else image
    buffer = io.BytesIO()
    # 4:4:4 chroma (no subsampling): small images keep their colour edges
    _pillow().fromarray(pixels).save(buffer, format="JPEG", quality=quality, subsampling=0)
    return bytes((JPEG,)) + buffer.getvalue()


def _decode_jpeg(data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    with _pillow().open(io.BytesIO(data)) as image:
        return np.asarray(image, dtype=np.uint8).reshape(shape)
