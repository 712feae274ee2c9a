"""PIL images, stored without pickle; Pillow is imported only once an image is seen or rebuilt.

An image is stored as its pixels as ``numpy.asarray`` gives them (uint8 ``(H, W[, C])`` for 8-bit
modes), its mode and size, and the palette of ``P``/``PA`` images; it comes back as a PIL image of the
same mode, size, pixels and palette (``info`` — EXIF, ICC profile, transparency — is not kept). Images
of one mode and size are a column (the mode is in the schema); palette images, and images whose size
or mode varies, go in the var blob. Batched, :mod:`nbkit.collate` stacks them as ``PILToTensor`` would:
``(N, C, H, W)``, uint8 for 8-bit modes (a channels-last view of the gathered rows); images of
different sizes raise a ``TypeError`` that names the fix.

Example:
    >>> from PIL import Image
    >>> img = pil_from_bytes(pil_to_bytes(Image.new("RGB", (3, 2), (1, 2, 3))), "sample")
    >>> img.mode, img.size, img.getpixel((0, 0))
    ('RGB', (3, 2), (1, 2, 3))
"""

from __future__ import annotations

import json
import struct
import sys

import numpy as np

from ..errors import CorruptCacheError
from ..trust import List, Obj, Str, check_json
from .kind import BYTES_HEADER, DIM, Kind, Leaf, native, nbytes, numpy_dtype

PALETTE_MODES = ("P", "PA")
#: The PIL image modes nbkit rebuilds (a mode read from a cache is one of these, or the cache is damaged).
PIL_MODES = ("1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB", "HSV", "I", "F",
             "I;16", "I;16L", "I;16B", "I;16N")
_PIL_HEADER = Obj({"m": Str(choices=PIL_MODES), "d": Str(max_len=16), "s": List(DIM, max_len=3),
                   "pm": Str(choices=PIL_MODES)}, required=("m", "d", "s"))


def is_pil_image(value) -> bool:
    if not type(value).__module__.startswith("PIL."):
        return False
    from PIL import Image

    return isinstance(value, Image.Image)


def pil_pixels(img) -> np.ndarray:
    """The pixels of a PIL image as ``numpy.asarray`` gives them: ``(H, W)`` or ``(H, W, bands)``,
    uint8 for 8-bit modes (bool for mode ``"1"``, uint16 / int32 / float32 for ``I;16`` / ``I`` / ``F``)."""
    return np.asarray(img)


def pil_from_pixels(mode: str, arr: np.ndarray, palette: tuple | None = None, where: str = "sample"):
    """The PIL image of ``mode`` whose pixels are ``arr`` (as :func:`pil_pixels` gave them), with
    ``palette = (palette_mode, bytes)`` for ``P``/``PA`` images."""
    try:
        from PIL import Image
    except ImportError as e:
        raise ImportError(f"{where} is a PIL image; reading it needs Pillow: pip install pillow") from e
    size = (arr.shape[1], arr.shape[0])
    if mode not in PIL_MODES or (palette is not None and palette[0] not in PIL_MODES):
        raise CorruptCacheError(f"{where}: stored PIL image has the unknown mode {mode!r}; the cache is damaged")
    try:
        data = np.packbits(arr, axis=1).tobytes() if mode == "1" else np.ascontiguousarray(arr).tobytes()
        img = Image.frombytes(mode, size, data)
        if palette is not None:
            img.putpalette(palette[1], rawmode=palette[0])
    except (ValueError, TypeError) as e:
        raise CorruptCacheError(f"{where}: stored PIL image (mode {mode!r}, size {size}) is malformed ({e})") from e
    return img


def pil_to_bytes(img) -> bytes:
    """A self-describing blob of one PIL image: pixels, mode, size and palette (never ``info``)."""
    arr = pil_pixels(img)
    palette = b""
    head = {"m": img.mode, "d": arr.dtype.str, "s": list(arr.shape)}
    if img.mode in PALETTE_MODES and img.palette is not None:
        head["pm"] = img.palette.mode
        palette = bytes(img.getpalette(rawmode=img.palette.mode) or ())
    header = json.dumps(head, separators=(",", ":")).encode()
    return b"".join([struct.pack("<I", len(header)), header, arr.tobytes(), palette])


def pil_from_bytes(data, where: str):
    """Inverse of :func:`pil_to_bytes`."""
    mv = memoryview(data)
    try:
        (hlen,) = struct.unpack_from("<I", mv, 0)
        head = json.loads(bytes(mv[4 : 4 + hlen]))
    except (struct.error, ValueError, RecursionError) as e:
        raise CorruptCacheError(f"{where}: stored PIL image header is malformed ({e})") from e
    head = check_json(head, _PIL_HEADER, f"{where} (its PIL image header)", "The stored sample is damaged.")
    mode, shape, dt = head["m"], tuple(head["s"]), numpy_dtype(head["d"])
    pos = 4 + hlen
    n = nbytes(shape, dt.itemsize)
    if len(shape) not in (2, 3) or pos + n > len(mv):
        raise CorruptCacheError(f"{where}: stored PIL image is truncated")
    arr = np.frombuffer(mv[pos : pos + n], dtype=dt).reshape(shape)
    palette = (head["pm"], bytes(mv[pos + n :])) if "pm" in head else None
    return pil_from_pixels(mode, arr, palette, where)


def stack_pil(images: list, where: str = "batch"):
    """A batch of PIL images as ``default_collate([PILToTensor()(im) for im in images])`` gives it:
    ``(N, C, H, W)``; ``TypeError`` naming the fix when their sizes or modes differ."""
    arrays = [pil_pixels(im) for im in images]
    shapes = {(a.dtype.str, a.shape) for a in arrays}
    if len(shapes) > 1:
        raise TypeError(
            f"nbkit cannot stack the PIL images of {where} into one tensor: they differ in size or mode "
            f"({', '.join(sorted({f'{im.mode} {im.size[0]}x{im.size[1]}' for im in images}))}). Make them one size "
            "in the source (e.g. transforms.Resize and CenterCrop), convert them per sample with "
            "transform=... (e.g. transforms.PILToTensor()), or pass a collate_fn that keeps a list."
        )
    import torch

    return channels_first(torch.from_numpy(native(np.stack(arrays))))


def channels_first(pixels):
    """Stacked PIL pixels ``(N, H, W[, C])`` as ``(N, C, H, W)``, PILToTensor's layout (a view:
    channels-last in memory, which convolutions take as is)."""
    return pixels.unsqueeze(1) if pixels.dim() == 3 else pixels.permute(0, 3, 1, 2)



def _collate_images(batch, *, collate_fn_map=None):
    return stack_pil(list(batch), "a batch")


class PilKind(Kind):
    """A ``PIL.Image.Image`` (column when mode and size agree and it has no palette, else var)."""

    name = "pil"
    var_dtype = False
    header_spec = BYTES_HEADER
    legacy_pickled = True  # nbkit before issue 17 pickled images where allowed

    def describe(self, leaf: Leaf) -> str:
        return f"PIL image {leaf.mode} {leaf.shape[1]}x{leaf.shape[0]}" if leaf.store == "col" else "PIL image"

    def claims(self, value) -> bool:
        return is_pil_image(value)

    def to_array(self, value) -> np.ndarray:
        return pil_pixels(value)

    def infer(self, values: list, column: int) -> Leaf | None:
        # One mode and size: a column of pixels; the mode lives in the schema. Palettes (P, PA)
        # differ per image, so those images, like mixed sizes or modes, go in the var blob.
        descs = {(v.mode, *self.dtype_shape(v)) for v in values}
        mode, dtype_name, shape = next(iter(descs))
        if len(descs) == 1 and mode not in PALETTE_MODES:
            return Leaf(self.name, "col", dtype_name, shape, column, mode)
        return Leaf(self.name, "var")

    def column_problem(self, leaf: Leaf) -> tuple | None:
        if leaf.mode not in PIL_MODES or len(leaf.shape) not in (2, 3):
            return "", (f"is a PIL image of mode {leaf.mode!r} and shape {list(leaf.shape)} (a known mode and 2 or 3 "
                        "dimensions expected)")
        return None

    def matcher(self, leaf: Leaf):
        mode, dtype, shape = leaf.mode, np.dtype(leaf.dtype), leaf.shape
        size = (shape[1], shape[0])

        def pil(v):
            if not is_pil_image(v) or v.mode != mode or v.size != size:
                return None
            arr = pil_pixels(v)
            return arr if arr.dtype == dtype and arr.shape == shape else None
        return pil

    def column_values(self, leaf: Leaf, col: np.ndarray) -> list:
        return [pil_from_pixels(leaf.mode, row) for row in col]

    def numpy_values(self, leaf: Leaf, col: np.ndarray) -> list:
        # The stored pixels, as np.asarray(image) gives them: no PIL image is made.
        return list(native(col))

    def numpy_batch(self, leaf: Leaf, batch):
        # (N, C, H, W) from collate back to the samples' layout: (N, H, W, C), (N, H, W) for one band.
        return batch[:, 0] if batch.shape[1] == 1 else batch.permute(0, 2, 3, 1)

    def encode_var(self, leaf: Leaf, value) -> bytes | None:
        return pil_to_bytes(value)

    def decode_var(self, leaf: Leaf, data, where: str, allow_pickle: bool):
        return pil_from_bytes(data, where)

    def to_freeform(self, value) -> tuple:
        data = pil_to_bytes(value)
        return {"k": self.name, "n": len(data)}, data

    def from_freeform(self, header: dict, data, where: str, allow_pickle: bool):
        return pil_from_bytes(data, where)

    def collate_column(self, leaf: Leaf, col):
        return channels_first(super().collate_column(leaf, col))

    def collate_values(self, values: list):
        return stack_pil(values, "a batch")

    def collate_types(self) -> dict:
        image = sys.modules.get("PIL.Image")  # PIL images in a batch of samples read one by one
        return {} if image is None else {image.Image: _collate_images}
