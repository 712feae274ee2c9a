"""What the notebook views share: ipywidgets (or an ``ImportError`` naming the extra), the check for
a kernel with a front end, the palette, and :class:`View`, which shows a widget in a kernel and one
line of text anywhere else (a terminal, a script, CI logs).

Example:
    >>> from nbkit.widgets.view import View, in_kernel
    >>> class Hello(View):
    ...     def text(self):
    ...         return "hello"
    >>> in_kernel(), repr(Hello())
    (False, 'Hello(hello)')
"""

from __future__ import annotations


from nbkit.extras import require
from nbkit.text import html_words, in_kernel

ipywidgets = require("ipywidgets", extra="notebook", feature="nbkit.widgets")

__all__ = ["View", "in_kernel", "status_html", "units_html", "ipywidgets", "RENDER_INTERVAL", "RED", "GREEN", "GREY", "AMBER"]

#: Front ends redraw a few times a second at most; more only costs kernel messages.
RENDER_INTERVAL = 0.2
RED, GREEN, GREY = "#c62828", "#2e7d32", "#555555"
#: Done, but not what was wanted (e.g. a partial cache exported): dark enough to read on white.
AMBER = "#a15c00"


def status_html(text: str, color: str = GREY, *, bold: bool = False) -> str:
    """One status line as HTML: ``text`` escaped, in ``color``."""
    weight = "bold" if bold else "normal"
    # Lines break between words, never at a path's "-" or "/"; only a word longer than a narrow
    # line (a long URL) may break inside itself.
    words = html_words(text)
    return (f'<div style="white-space:normal;word-break:normal;overflow-wrap:break-word;line-height:1.5">'
            f'<span style="color:{color};font-weight:{weight}">{words}</span></div>')


def units_html(units, *, color: str = GREY, path_first: bool = False) -> str:
    """Units (HTML) joined by " · ", each kept whole on one line: a narrow screen wraps between
    units, never inside one, and a separator never starts a line. ``path_first``: the first unit
    holds a path, which may break inside itself when it is longer than the line.

    Example:
        >>> units_html(["1,000 samples", "1.2 MB of sample data"]).count("white-space:nowrap")
        2
    """
    spans = []
    for i, unit in enumerate(units):
        style = "display:inline-block" if i or not path_first else "display:inline"
        style += "" if i == 0 and path_first else ";white-space:nowrap"
        style += f";color:{color}" if color and (i or not path_first) else ""
        # Inside the unit, so never at the start of a line (bound to a path that may itself break).
        sep = ("&nbsp;·" if i == 0 and path_first else " ·") if i < len(units) - 1 else ""
        spans.append(f"<span style='{style}'>{unit}{sep}</span>")
    return "<div style='white-space:normal;line-height:1.6'>" + " ".join(spans) + "</div>"


class View:
    """A view: ``widget`` in a kernel, ``text()`` (one line) anywhere else. Subclasses set
    ``widget`` and implement ``text()``; ``terminal`` says which of the two this process shows."""

    widget = None
    terminal = True

    def text(self) -> str:
        raise NotImplementedError

    def _ipython_display_(self):
        if self.terminal:
            print(self.text())
        else:
            from IPython.display import display

            display(self.widget)

    def __repr__(self):
        return f"{type(self).__name__}({self.text()})"
