"""report.html's images: matplotlib figures as PNGs embedded as base64 (the page needs no
other file)."""

from __future__ import annotations

import base64
import html
import io
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen first)


def png(fig: Any) -> bytes:
    """``fig`` as PNG bytes (the figure is closed)."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def img(data: bytes, alt: str) -> str:
    """An ``<img>`` holding the PNG ``data``."""
    encoded = base64.b64encode(data).decode("ascii")
    return f"<img alt='{html.escape(alt, quote=True)}' src='data:image/png;base64,{encoded}'>"
