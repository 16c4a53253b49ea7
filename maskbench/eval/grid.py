"""Sample grids a person can read: each sample enlarged, with its prompt written under it.

A 32-pixel sample shown at 32 pixels cannot be judged against its caption by eye, and without the
caption there is nothing to judge it against. So every tile is enlarged by a whole factor with nearest
neighbour (each sample pixel becomes a block: nothing is smoothed or invented, and the tile still holds
the sample exactly), and its prompt is wrapped under it in PIL's built-in bitmap font (no font files to
find or download, the same glyphs on every machine).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

GRID_FILE = "grid.png"      # an eval point's grid, beside its per-sample PNGs
MIN_TILE = 128              # tiles are enlarged to at least this many pixels a side
MAX_CAPTION_LINES = 8       # a longer caption is cut, its last line ending in "..."
PAD = 4                     # pixels between tiles and around the text
BACKGROUND, INK = (255, 255, 255), (0, 0, 0)


def upscale_factor(side: int, min_tile: int = MIN_TILE) -> int:
    """The whole factor that enlarges a `side`-pixel sample to at least `min_tile` pixels (1 if already there)."""
    return max(1, math.ceil(min_tile / side))


def wrap_caption(caption: str, width: int, max_lines: int = MAX_CAPTION_LINES) -> list[str]:
    """The caption in lines of at most `width` characters, cut to `max_lines`. Characters the bitmap font
    lacks (it is Latin-1) become '?' rather than failing the eval point."""
    text = caption.encode("latin-1", "replace").decode("latin-1")
    lines = textwrap.wrap(text, width, break_long_words=True) or [""]
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = lines[-1][:max(0, width - 3)] + "..."
    return lines


def prompt_grid(images: np.ndarray, captions: Sequence[str], n_cols: int | None = None,
                min_tile: int = MIN_TILE) -> Image.Image:
    """The N×H×W×3 uint8 samples as a grid of tiles enlarged to >= min_tile pixels, each prompt under its tile.

    n_cols defaults to a square-ish layout (ceil √N). Every row of tiles leaves room for the longest
    wrapped caption, so tiles line up in rows and columns. Tile i sits at
    (PAD + col·(tile_w + PAD), PAD + row·(tile_h + text_h + PAD)).
    """
    images = np.asarray(images)                                                     # N×H×W×3
    if len(images) != len(captions):
        raise ValueError(f"{len(images)} images but {len(captions)} captions")
    n, height, width = images.shape[:3]
    scale = upscale_factor(min(height, width), min_tile)
    tile_w, tile_h = width * scale, height * scale
    font = ImageFont.load_default_imagefont()
    char_w = int(font.getlength("M"))                                               # the bitmap font is monospaced
    line_h = font.getbbox("Mg")[3] + 1
    wrapped = [wrap_caption(caption, max(1, tile_w // char_w)) for caption in captions]
    text_h = PAD + line_h * max((len(lines) for lines in wrapped), default=1)
    n_cols = n_cols or max(1, math.ceil(math.sqrt(n)))
    n_rows = max(1, math.ceil(n / n_cols))
    grid = Image.new("RGB", (PAD + n_cols * (tile_w + PAD), PAD + n_rows * (tile_h + text_h + PAD)), BACKGROUND)
    draw = ImageDraw.Draw(grid)
    for i, (image, lines) in enumerate(zip(images, wrapped)):
        x = PAD + (i % n_cols) * (tile_w + PAD)
        y = PAD + (i // n_cols) * (tile_h + text_h + PAD)
        grid.paste(Image.fromarray(image).resize((tile_w, tile_h), Image.Resampling.NEAREST), (x, y))
        draw.multiline_text((x, y + tile_h + PAD), "\n".join(lines), fill=INK, font=font, spacing=1)
    return grid
