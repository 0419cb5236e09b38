"""Aligned tables and wrapped prose for a terminal of a given width: what every command's readable form is made
of (``kvsim.cli.render`` and the commands that print their own tables)."""

from __future__ import annotations


def aligned(headers: list[str], rows: list[list], text: bool = False, width: int | None = None) -> str:
    """Columns padded to their widest cell; ``text`` left-aligns everything. ``width``: a table wider than
    that many columns wraps its cells, words (and a header's parts, after each ``_``) onto more lines, so
    that it fits where it can (``fitted``); None, or a table that fits, is one line per row."""
    cells = [[_cell(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    if width is not None and sum(widths) + 2 * (len(widths) - 1) > width:
        return _fitted(headers, cells, text, width)

    def line(items):
        # text left, numbers right, so columns of figures line up on the decimal point
        return "  ".join(
            s.rjust(w) if _numeric(s) and not text else s.ljust(w) for s, w in zip(items, widths, strict=True)
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def _words(s: str, header: bool = False) -> list[str]:
    """Where a cell may break: after each space (kept on the earlier piece), or, in a header, after each ``_``."""
    if _numeric(s) and not header:
        return [s]
    cut = "_" if header else " "
    pieces = s.split(cut)
    return [p + cut for p in pieces[:-1]] + [pieces[-1]]


def _wrap(s: str, w: int, header: bool = False) -> list[str]:
    """``s`` in lines of at most ``w`` columns, broken only where ``_words`` allows (a longer piece stands alone)."""
    lines = [""]
    for piece in _words(s, header):
        if lines[-1] and len((lines[-1] + piece).rstrip()) > w:
            lines.append("")
        lines[-1] += piece
    return [x.rstrip() for x in lines]


def _fitted(headers: list[str], cells: list[list[str]], text: bool, width: int) -> str:
    """``aligned``'s table in ``width`` columns: each column as narrow as its longest unbreakable piece, then
    the room left spent where it saves the most lines (of the table, then of its cells) per column given; rows as
    tall as their tallest cell."""
    columns = list(zip(headers, *cells, strict=True))
    least = [max(len(p) for i, c in enumerate(col) for p in _words(c, header=i == 0)) for col in columns]
    most = [max(len(c) for c in col) for col in columns]
    # the lines each cell takes at each width its column may have (the header's first)
    lines = [{w: [len(_wrap(c, w, header=i == 0)) for i, c in enumerate(col)] for w in range(lo, hi + 1)}
             for col, lo, hi in zip(columns, least, most, strict=True)]

    def height(widths: list[int]) -> int:
        """The table's lines, then (below a thousandth of one) its cells' lines: a row shorter first, a cell next."""
        per_column = [lines[j][w] for j, w in enumerate(widths)]
        rows = sum(max(col[r] for col in per_column) for r in range(len(columns[0])))
        return 1000 * rows + sum(map(sum, per_column))

    widths = list(least)
    room = width - sum(widths) - 2 * (len(widths) - 1)
    while room > 0:
        now, best = height(widths), None
        for j in range(len(widths)):
            for w in range(widths[j] + 1, min(most[j], widths[j] + room) + 1):
                saved = now - height([*widths[:j], w, *widths[j + 1:]])
                if saved > 0:
                    if best is None or saved / (w - widths[j]) > best[0]:
                        best = (saved / (w - widths[j]), j, w)
                    break  # the narrowest width that saves a line; a wider one is weighed on the next round
        if best is None:
            break
        room -= best[2] - widths[best[1]]
        widths[best[1]] = best[2]

    def block(items: list[str], header: bool = False) -> list[str]:
        wrapped = [_wrap(s, w, header) for s, w in zip(items, widths, strict=True)]
        tall = max(len(x) for x in wrapped)
        return ["  ".join((s.rjust(w) if _numeric(s) and not text and not header else s.ljust(w))
                          for s, w in zip((x[k] if k < len(x) else "" for x in wrapped), widths, strict=True)).rstrip()
                for k in range(tall)]

    return "\n".join([*block(headers, header=True), "  ".join("-" * w for w in widths).rstrip(),
                      *(line for r in cells for line in block(r))])


def prose(s: str, width: int | None) -> str:
    """A sentence of a rendered document, wrapped at word boundaries to ``width`` (None: one line)."""
    if width is None or len(s) <= width:
        return s
    import textwrap

    return textwrap.fill(s, width, break_long_words=False, break_on_hyphens=False)


def _cell(x) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.4f}"
    return str(x)


def _numeric(s: str) -> bool:
    if s == "n/a":
        return True
    try:
        float(s)
    except ValueError:
        return False
    return True
