"""A legend that covers no data: `data_under_legend` finds the artists a legend lies over and
`keep_legend_off_data` raises the count axis until there are none (matplotlib's `loc="best"` places a
legend where it covers least, which is not nothing). Used by `lib.report.plotting`'s figures and the
evidence figures (`lib.report.evidence_figures`)."""

from __future__ import annotations

from typing import Any, List

REFERENCE = "reference"
"""The `gid` of lines drawn for reference across a whole axes (3σ, 5σ): not data a legend must avoid."""
LEGEND_MARGIN = 0.03
"""Room kept between the legend and the highest data under it [axes fraction]."""


def _display_paths(artist: Any) -> List[Any]:
    """The paths `artist` draws, in display coordinates: a line's (its markers' centres where it has
    no line), a patch's outline, each path of a collection (error bars, bands)."""
    from matplotlib.collections import Collection
    from matplotlib.lines import Line2D
    from matplotlib.path import Path as MplPath

    if isinstance(artist, Line2D):
        xy = artist.get_transform().transform(artist.get_xydata())
        if artist.get_linestyle() in ("None", "none", "", " ") or len(xy) < 2:
            return [MplPath(point[None, :]) for point in xy]  # each marker alone
        return [MplPath(xy)]
    if isinstance(artist, Collection):
        transform = artist.get_transform()
        return [transform.transform_path(path) for path in artist.get_paths()]
    return [artist.get_transform().transform_path(artist.get_path())]


def data_under_legend(ax: Any) -> List[Any]:
    """The artists of `ax` (lines, markers, bars, error bars; not `REFERENCE` lines) that its legend,
    as last drawn, lies over."""
    legend = ax.get_legend()
    if legend is None:
        return []
    box = legend.get_window_extent(ax.figure.canvas.get_renderer())
    covered = []
    for artist in [*ax.lines, *ax.patches, *ax.collections]:
        if not artist.get_visible() or artist.get_gid() == REFERENCE:
            continue
        for path in _display_paths(artist):
            vertices = path.vertices
            if box.contains(*vertices[0]) if len(vertices) == 1 else path.intersects_bbox(box, filled=False):
                covered.append(artist)
                break
    return covered


def keep_legend_off_data(ax: Any, tries: int = 8) -> Any:
    """Raise the top of `ax`'s count axis until its legend (placed where it covers least, as
    matplotlib places it) lies over no data (`data_under_legend`): each try makes the room the
    covered data need below the legend's lower edge. The axes are measured where they stand before
    the figure's layout moves them (laying it out each time doubled the time a spectrum takes to
    draw); `LEGEND_MARGIN` keeps room for that move."""
    if ax.get_legend() is None:
        return ax
    fig = ax.figure
    for _ in range(tries):
        if not data_under_legend(ax):
            break
        legend_bottom = ax.transAxes.inverted().transform(
            ax.get_legend().get_window_extent(fig.canvas.get_renderer()).p0
        )[1]
        room = max(legend_bottom - LEGEND_MARGIN, 0.2)  # of the axes' height, below the legend
        low, high = ax.get_ylim()
        if ax.get_yscale() == "log":
            ax.set_ylim(low, low * (high / low) ** (1.0 / room))
        else:
            ax.set_ylim(low, low + (high - low) / room)
    return ax
