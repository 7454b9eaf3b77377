"""The loss curve as a PNG, drawn with NumPy and written with zlib (no plotting library needed)."""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

WHITE, GRID, AXIS, TEXT = (255, 255, 255), (228, 228, 228), (90, 90, 90), (40, 40, 40)
TRAIN, EVAL = (31, 119, 180), (255, 127, 14)
# 3x5 glyphs, rows top to bottom; drawn at SCALE
_FONT = {c: rows.split() for c, rows in {
    "0": "111 101 101 101 111", "1": "010 110 010 010 111", "2": "111 001 111 100 111",
    "3": "111 001 111 001 111", "4": "101 101 111 001 001", "5": "111 100 111 001 111",
    "6": "111 100 111 101 111", "7": "111 001 001 010 010", "8": "111 101 111 101 111",
    "9": "111 101 111 001 111", ".": "000 000 000 000 010", "-": "000 000 111 000 000",
    "+": "000 010 111 010 000", "A": "010 101 111 101 101", "E": "111 100 110 100 111",
    "I": "111 010 010 010 111", "L": "100 100 100 100 111", "N": "110 101 101 101 101",
    "O": "010 101 101 101 010", "P": "110 101 110 100 100", "R": "110 101 110 101 101",
    "S": "011 100 010 001 110", "T": "111 010 010 010 010", "V": "101 101 101 101 010",
    " ": "000 000 000 000 000"}.items()}
SCALE = 2


def png(image: np.ndarray) -> bytes:
    """An 8-bit RGB PNG of ``image`` (``[height, width, 3]`` uint8)."""
    h, w, _ = image.shape
    rows = np.concatenate([np.zeros((h, 1), np.uint8), image.reshape(h, w * 3)], axis=1)  # filter 0 per row

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows.tobytes(), 9)) + chunk(b"IEND", b""))


def _text(img: np.ndarray, x: int, y: int, text: str, color: tuple[int, int, int],
          anchor: str = "left") -> None:
    """Draw ``text`` with its top at ``y``; ``anchor`` says whether ``x`` is its left, center or right."""
    text = text.upper()
    width = len(text) * 4 * SCALE - SCALE
    x -= {"left": 0, "center": width // 2, "right": width}[anchor]
    for i, c in enumerate(text):
        for r, row in enumerate(_FONT.get(c, _FONT[" "])):
            for k, bit in enumerate(row):
                if bit == "1":
                    px, py = x + (4 * i + k) * SCALE, y + r * SCALE
                    img[max(py, 0):py + SCALE, max(px, 0):px + SCALE] = color


def _polyline(img: np.ndarray, xs: np.ndarray, ys: np.ndarray, color: tuple[int, int, int]) -> None:
    """Connect the points, two pixels thick."""
    if len(xs) == 1:
        xs, ys = np.repeat(xs, 2), np.repeat(ys, 2)
    px, py = [], []
    for x0, y0, x1, y1 in zip(xs[:-1], ys[:-1], xs[1:], ys[1:], strict=True):
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 2
        px.append(np.linspace(x0, x1, n))
        py.append(np.linspace(y0, y1, n))
    x, y = np.rint(np.concatenate(px)).astype(int), np.rint(np.concatenate(py)).astype(int)
    h, w, _ = img.shape
    for dx, dy in ((0, 0), (1, 0), (0, 1), (1, 1)):
        img[np.clip(y + dy, 0, h - 1), np.clip(x + dx, 0, w - 1)] = color


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round values in [lo, hi], about ``n`` of them (steps of 1, 2 or 5 times a power of ten)."""
    raw = (hi - lo) / n
    base = 10 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 5, 10) if m * base >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _label(v: float) -> str:
    return f"{v:.0f}" if abs(v - round(v)) < 1e-9 and abs(v) < 1e6 else f"{v:.3g}"


def loss_curve(path: str | Path, steps: Sequence[int], losses: Sequence[float],
               eval_steps: Sequence[int] = (), eval_losses: Sequence[float] = (), *,
               size: tuple[int, int] = (720, 420)) -> Path:
    """Write the training loss (blue) and eval loss (orange, with markers) against the step."""
    w, h = size
    left, right, top, bottom = 64, 16, 28, 44
    img = np.full((h, w, 3), WHITE, np.uint8)
    points = [(s, v) for s, v in zip([*steps, *eval_steps], [*losses, *eval_losses], strict=True)
              if math.isfinite(v)]
    xs_all = [s for s, _ in points] or [0, 1]
    ys_all = [v for _, v in points] or [0.0, 1.0]
    x_lo, x_hi = min(xs_all), max(max(xs_all), min(xs_all) + 1)
    y_lo, y_hi = min(ys_all), max(ys_all)
    pad = max((y_hi - y_lo) * 0.05, 1e-3)
    y_lo, y_hi = y_lo - pad, y_hi + pad

    def sx(v: np.ndarray) -> np.ndarray:
        return left + (np.asarray(v, float) - x_lo) / (x_hi - x_lo) * (w - left - right - 1)

    def sy(v: np.ndarray) -> np.ndarray:
        return top + (y_hi - np.asarray(v, float)) / (y_hi - y_lo) * (h - top - bottom - 1)

    for t in _ticks(y_lo, y_hi):
        y = round(float(sy(np.array(t))))
        img[y, left:w - right] = GRID
        _text(img, left - 6, y - 5, _label(t), TEXT, "right")
    for t in _ticks(x_lo, x_hi, 6):
        x = round(float(sx(np.array(t))))
        img[top:h - bottom, x] = GRID
        _text(img, x, h - bottom + 6, _label(t), TEXT, "center")
    img[top:h - bottom, left] = AXIS
    img[h - bottom - 1, left:w - right] = AXIS
    _text(img, (left + w - right) // 2, h - 16, "step", TEXT, "center")
    _text(img, left, 8, "loss", TEXT)

    train = [(s, v) for s, v in zip(steps, losses, strict=True) if math.isfinite(v)]
    if train:
        _polyline(img, sx([s for s, _ in train]), sy([v for _, v in train]), TRAIN)
    evals = [(s, v) for s, v in zip(eval_steps, eval_losses, strict=True) if math.isfinite(v)]
    if evals:
        ex, ey = sx([s for s, _ in evals]), sy([v for _, v in evals])
        _polyline(img, ex, ey, EVAL)
        for x, y in zip(np.rint(ex).astype(int), np.rint(ey).astype(int), strict=True):
            img[max(y - 3, 0):y + 4, max(x - 3, 0):x + 4] = EVAL
    legend_x = w - right - 120
    for i, (name, color) in enumerate((("train", TRAIN), ("eval", EVAL))):
        x = legend_x + i * 64
        img[9:17, x:x + 12] = color
        _text(img, x + 16, 8, name, TEXT)
    path = Path(path)
    path.write_bytes(png(img))
    return path
