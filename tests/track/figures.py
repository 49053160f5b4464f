"""Read back what a matplotlib Figure of autoprec.track.plots draws (its one axes), so the
plot tests check the data on it, not only that a PNG was written."""

from __future__ import annotations

from typing import Any

Point = tuple[float, float]


def _axes(fig: Any) -> Any:
    (ax,) = fig.axes
    return ax


def series(fig: Any) -> dict[str, list[Point]]:
    """Every labelled scatter (its offsets) and line (its x, y data), by legend label."""
    ax = _axes(fig)
    out: dict[str, list[Point]] = {}
    for artist, xy in [*((c, c.get_offsets()) for c in ax.collections),
                       *((ln, ln.get_xydata()) for ln in ax.get_lines())]:
        label = str(artist.get_label())
        if not label.startswith("_"):  # matplotlib's name for an unlabelled artist
            assert label not in out, f"two series labelled {label!r}"
            out[label] = [(float(x), float(y)) for x, y in xy]
    return out


def legend(fig: Any) -> list[str]:
    """The legend's entries, in order."""
    return [t.get_text() for t in _axes(fig).get_legend().get_texts()]


def bars(fig: Any) -> list[tuple[str, float, str]]:
    """Horizontal bars top to bottom: (tick label at the bar, length, colour as #rrggbb).
    The label is "" where the axis has no tick at the bar."""
    from matplotlib.colors import to_hex

    ax = _axes(fig)
    ticks = {round(float(y)): t.get_text() for y, t in zip(ax.get_yticks(), ax.get_yticklabels())}
    rects = sorted(ax.patches, key=lambda r: -(r.get_y() + r.get_height() / 2))
    return [(ticks.get(round(r.get_y() + r.get_height() / 2), ""), float(r.get_width()),
             to_hex(r.get_facecolor())) for r in rects]


def texts(fig: Any) -> list[str]:
    """The text annotations on the axes, in drawing order."""
    return [t.get_text() for t in _axes(fig).texts]
