"""Numbers and tables as people read them: one formatter per quantity and one table renderer.

Every view in nbkit (the notebook widgets, the text progress line, the benchmark tables and plots,
the TPU runtime report) formats through this module, so a quantity reads the same everywhere:
bytes in decimal units (``"1.5 MB"``), durations as ``"3.2s"`` / ``"1m15s"``, counts with
thousands separators, rates per second, and a :class:`Table` rendered as aligned text, Markdown
or HTML. Text that came from outside (a cache's metadata, a path, a URL, an error quoting them)
goes through :func:`printable` before it reaches a terminal, so it can never carry an escape
sequence that retitles, clears or rewrites the screen.

Example:
    >>> from nbkit.text import Table, format_bytes, format_rate, format_seconds
    >>> format_bytes(1_500_000), format_seconds(75.2), format_rate(5400, "samples")
    ('1.5 MB', '1m15s', '5,400 samples/s')
    >>> print(Table([("runtime", "cpu"), ("torch", "2.9.0")]).text())
    runtime  cpu
    torch    2.9.0
"""

from __future__ import annotations

import contextlib
import contextvars
import html
import logging
import re
import shutil
import sys
import textwrap
import threading
import unicodedata
from typing import Sequence

__all__ = ["printable", "format_bytes", "format_count", "format_amount", "format_rate", "format_seconds", "format_percent",
           "format_list", "fill", "say", "in_kernel", "html_words", "NARROW_COLUMNS", "Table", "plural", "format_age",
           "FRONT_ENDS", "FIXES", "front_end", "speaking_to", "fix", "quiet_loggers"]

#: The characters of monospaced output that fit a 400-pixel notebook (a phone, Colab's side panel).
#: Measured in headless Chromium at a 400 px viewport (tests/test_browser.py measures it again in
#: both front ends, short and long outputs): JupyterLab 4 holds 35 columns of a cell's printed text,
#: the classic Notebook 6 exactly 28 (240 px of a 14 px font). Both break a longer line anywhere,
#: mid-word. Two columns less than the classic's: a line filled to the last column broke there
#: ("ther / e", "60,00 / 0") where a glyph came from a wider fallback font ("–", "×", "±") or the
#: front end's font differs (Colab's), so the room is kept, not assumed.
NARROW_COLUMNS = 26


#: Unicode categories never shown as they are: controls (C0, DEL, C1: ESC starts a terminal escape
#: sequence), format characters (bidi overrides and isolates, zero-width joiners), lone surrogates
#: (undecodable bytes of a file name), and the line and paragraph separators.
_UNSAFE_CATEGORIES = frozenset(("Cc", "Cf", "Cs", "Zl", "Zp"))
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text) -> str:
    """``text`` (``str()`` of anything) safe to show in a terminal or a table cell: every control or
    format character, newlines included, replaced by its Python escape (``\\x1b``, ``\\n``,
    ``\\u202e``); everything else as it is.

    Example:
        >>> print(printable("mnist" + chr(27) + "]0;pwned" + chr(7) + chr(10) + "x"))
        mnist\\x1b]0;pwned\\x07\\nx
        >>> printable("caf\u00e9 " + chr(0x202e) + "gnp.exe")
        'café \\\\u202egnp.exe'
    """
    text = str(text)
    if text.isprintable():  # the common case: no control or format characters, and no separators but " "
        return text
    return "".join(_escape(ch) if unicodedata.category(ch) in _UNSAFE_CATEGORIES else ch for ch in text)


def format_bytes(n) -> str:
    """Bytes in decimal units: ``512`` → ``'512 B'``, ``1_500_000`` → ``'1.5 MB'``.

    Every size nbkit shows goes through here (never MiB beside MB), with words that say what it
    counts: ``"… of sample data"`` (:attr:`nbkit.stats.Stats.bytes`) or ``"… on disk (sample data,
    index and metadata)"`` (allocated blocks: :attr:`~nbkit.stats.Stats.disk_bytes`, ``nbkit ls``).
    """
    n = float(n or 0)
    if abs(n) < 1000:
        return f"{n:.0f} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1000
        if abs(n) < 1000:
            return f"{n:.1f} {unit}"
    return f"{n / 1000:.1f} TB"


def format_count(n, *, compact: bool = False) -> str:
    """``12345`` → ``'12,345'``; with ``compact=True`` (plot labels) ``'12k'``, ``1.5e6`` → ``'1.5M'``."""
    if compact:
        if n >= 1e6:
            return f"{n / 1e6:.3g}M"
        if n >= 1e3:
            return f"{n / 1e3:.0f}k"
    return f"{n:,.0f}"


def format_amount(n, unit: str) -> str:
    """An amount of ``unit``: bytes with their unit (``'1.5 MB'``), anything else as a count (``'1,200'``)."""
    return format_bytes(n) if unit == "bytes" else format_count(n)


def format_rate(rate: float, unit: str = "samples") -> str:
    """Units per second: ``'5,400 samples/s'``, or ``'1.5 MB/s'`` for ``unit="bytes"``."""
    return f"{format_bytes(rate)}/s" if unit == "bytes" else f"{format_count(rate)} {unit}/s"


def format_seconds(seconds: float, *, digits: int = 1) -> str:
    """A duration: ``0.012`` → ``'12ms'``, ``3.21`` → ``'3.2s'`` (``digits=2``: ``'3.21s'``), ``75.2`` → ``'1m15s'``, ``7300`` → ``'2h01m'``."""
    if 0 < seconds < 0.1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.{digits}f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def format_list(items, *, limit: int = 10, show=str) -> str:
    """The first ``limit`` of ``items`` (each through ``show``), then ``…`` if there are more: for error messages.

    Example:
        >>> format_list(range(12)), format_list(["a"], show=repr)
        ('0, 1, 2, 3, 4, 5, 6, 7, 8, 9 …', "'a'")
    """
    items = list(items)
    return ", ".join(map(show, items[:limit])) + (" …" if len(items) > limit else "")


class _Filler(textwrap.TextWrapper):
    """textwrap's filler that breaks at spaces only, and a path longer than a line after a ``/``."""

    def _split(self, text):
        chunks = []
        for chunk in super()._split(text):
            if len(chunk) > self.width and "/" in chunk.strip("/"):
                chunks.extend(p for p in re.split(r"(?<=/)(?=[^/])", chunk) if p)
            else:
                chunks.append(chunk)
        return chunks


def fill(text: str, width: int = NARROW_COLUMNS) -> str:
    """``text`` in lines of at most ``width`` characters, broken at spaces only (never inside a word,
    never at a hyphen); its own line breaks are kept. A path longer than ``width`` is broken after a
    ``/`` (``cache/`` then ``mnist-checkpoint.pt``); any other word longer than ``width`` stays whole.

    Example:
        >>> print(fill("reopened cache/mnist without its source: 60,000 samples", 24))
        reopened cache/mnist
        without its source:
        60,000 samples
        >>> print(fill("checkpoint: /content/drive/MyDrive/nbkit/mnist-checkpoint.pt", 28))
        checkpoint: /content/drive/
        MyDrive/nbkit/
        mnist-checkpoint.pt
    """
    filler = _Filler(width, break_long_words=False, break_on_hyphens=False)
    return "\n".join(filler.fill(line) if line else "" for line in str(text).split("\n"))


def html_words(text: str, *, longest: int = 40) -> str:
    """``text`` escaped for HTML, each word that a browser would break inside (at ``-``, ``/``, ``–``,
    ``—`` or a comma inside it, as in ``[[0,1],[2,3]]``) kept on one line: a narrow screen then wraps between words only. A word longer than
    ``longest`` characters (a long URL) is left free to break, so it cannot push past the edge.

    Example:
        >>> html_words("about 81× (72–86×) & more")
        "about 81× <span style='white-space:nowrap'>(72–86×)</span> &amp; more"
    """
    def keep(m):
        word = m.group(0)
        return f"<span style='white-space:nowrap'>{word}</span>" if re.search(r"[-/–—]|,\S", word) else word

    return re.sub(r"(?<!\S)\S{1,%d}(?!\S)" % longest, keep, html.escape(str(text)))


def in_kernel() -> bool:
    """True inside a Jupyter/Colab/Voila kernel (a notebook's output), False in a terminal or a script.

    Example:
        >>> in_kernel()  # a doctest runs in a plain interpreter
        False
    """
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def say(text: str, width: int | None = None) -> None:
    """Print ``text`` through :func:`fill`, flushed: what nbkit prints for people to read. In a
    notebook it fits a 400-pixel output (:data:`NARROW_COLUMNS`) without a word broken in two; in a
    terminal it fills the terminal's width; it shows before a slow step either way.

    Example:
        >>> say("built cache/mnist: 60,000 samples computed", 30)
        built cache/mnist: 60,000
        samples computed
    """
    if width is None:
        width = NARROW_COLUMNS if in_kernel() else max(NARROW_COLUMNS, shutil.get_terminal_size().columns - 1)
    print(fill(text, width), flush=True)


def format_percent(fraction: float, *, digits: int = 1, missing: str = "–") -> str:
    """``0.756`` → ``'75.6%'``; ``None`` (no data yet) → ``missing``."""
    return missing if fraction is None else f"{100.0 * fraction:.{digits}f}%"


class Table:
    """Rows of cells rendered as aligned text, Markdown or HTML: the one table renderer of nbkit.

    Args:
        rows: sequences of cells (anything ``str()`` can render; shown through :func:`printable`).
        header: column names, or ``None`` for a table without a header row (key/value reports).
        align: one letter per column for HTML, ``"l"`` or ``"r"`` (default: the browser's).
        notes: lines shown under the table (a list in HTML); each may span lines, shown through :func:`printable`.
        note_prefix: put before each note in the text form, e.g. ``"warning: "``.

    Example:
        >>> t = Table([("raw", "2.00"), ("cached", "0.25")], header=("dataset", "seconds"))
        >>> print(t.markdown())
        | dataset | seconds |
        |---|---|
        | raw | 2.00 |
        | cached | 0.25 |
        >>> t.html().count("<tr>")
        3
    """

    def __init__(self, rows, header: Sequence | None = None, *, align: str = "", notes: Sequence = (), note_prefix: str = ""):
        # Cells may quote a cache's metadata, a path or an error: made printable once here, so that
        # every form (text, Markdown, HTML) shows escapes rather than running them; a cell stays one line.
        self.rows = [tuple(printable(c) for c in row) for row in rows]
        self.header = None if header is None else tuple(printable(h) for h in header)
        self.align = align
        self.notes = tuple("\n".join(map(printable, str(n).split("\n"))) for n in notes)  # a note may span lines
        self.note_prefix = note_prefix

    def text(self) -> str:
        """Columns padded to their widest cell, two spaces apart, then the notes."""
        lines = ([self.header] if self.header else []) + self.rows
        if not lines:
            return "\n".join(self.note_prefix + n for n in self.notes)
        widths = [max(len(line[i]) for line in lines if i < len(line)) for i in range(max(map(len, lines)))]
        out = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
        return "\n".join(out + [self.note_prefix + n for n in self.notes])

    def markdown(self) -> str:
        """A Markdown (GitHub) table; needs a header."""
        if self.header is None:
            raise ValueError("Table.markdown() needs a header row: pass header=(...) to Table")
        lines = ["| " + " | ".join(self.header) + " |", "|" + "---|" * len(self.header)]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)

    def html(self, *, css_class: str = "", style: str = "", cell_style: str = "", column_styles: Sequence[str] = (),
             row_styles: Sequence[str] = (), row_headers: bool = False, note_style: str = "",
             keep_words: bool = False) -> str:
        """An HTML table (cells escaped).

        Args:
            css_class, style: the ``<table>``'s ``class`` and ``style``.
            cell_style: CSS for every cell; ``column_styles[k]`` is added to column ``k``.
            row_styles: CSS for each body row (``""`` for none).
            row_headers: the first cell of each row is a ``<th>`` (key/value reports).
            note_style: CSS of the notes' ``<ul>``.
            keep_words: cells and notes wrap between words only (:func:`html_words`), for narrow screens.
        """
        escape = html_words if keep_words else html.escape
        def cell(tag, k, text):
            parts = [cell_style]
            if k < len(self.align) and self.align[k] in "lr":
                parts.append(f"text-align:{'left' if self.align[k] == 'l' else 'right'}")
            if k < len(column_styles):
                parts.append(column_styles[k])
            css = ";".join(p for p in parts if p)
            attr = f" style='{css}'" if css else ""
            return f"<{tag}{attr}>{escape(text)}</{tag}>"

        body = []
        for r, row in enumerate(self.rows):
            css = row_styles[r] if r < len(row_styles) else ""
            tds = "".join(cell("th" if row_headers and k == 0 else "td", k, c) for k, c in enumerate(row))
            body.append((f"<tr style='{css}'>" if css else "<tr>") + tds + "</tr>")
        if self.header is not None:
            head = "<tr>" + "".join(cell("th", k, h) for k, h in enumerate(self.header)) + "</tr>"
            inner = f"<thead>{head}</thead><tbody>{''.join(body)}</tbody>"
        else:
            inner = "".join(body)
        attrs = (f" class='{css_class}'" if css_class else "") + (f" style='{style}'" if style else "")
        out = f"<table{attrs}>{inner}</table>"
        if self.notes:
            items = "".join(f"<li>{escape(n)}</li>" for n in self.notes)
            out += (f"<ul style='{note_style}'>" if note_style else "<ul>") + items + "</ul>"
        return out


def plural(n, noun: str, many: str | None = None) -> str:
    """``n`` and ``noun``, the noun in the plural unless ``n`` is 1: ``"1 cache"``, ``"2 caches"``, ``"0 caches"``.

    Example:
        >>> plural(1, "cache"), plural(3, "file"), plural(2, "copy", "copies"), plural(1200, "sample")
        ('1 cache', '3 files', '2 copies', '1,200 samples')
    """
    return f"{format_count(n)} {noun if n == 1 else many or noun + 's'}"


def format_age(seconds: float) -> str:
    """How long ago, as people say it: ``'40s ago'``, ``'12 minutes ago'``, ``'5 hours ago'``, ``'10 days ago'``.

    Example:
        >>> format_age(40), format_age(90), format_age(3 * 3600), format_age(240 * 3600 + 60), format_age(400 * 86400)
        ('40s ago', '2 minutes ago', '3 hours ago', '10 days ago', '400 days ago')
    """
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.0f}s ago"
    unit, size = next((u, s) for u, s in (("day", 86400), ("hour", 3600), ("minute", 60))
                      if seconds >= 2 * s or u == "minute")  # "90 minutes", "36 hours": two of a unit at least
    return plural(int(round(seconds / size)), unit) + " ago"


# -- fixes worded for where the user is -------------------------------------------------------------

#: Where nbkit's user is: Python (a script or a notebook cell), the ``nbkit`` shell command, or a
#: notebook panel's buttons (:class:`nbkit.widgets.WarmupPanel`).
FRONT_ENDS = ("python", "shell", "panel")
_FRONT_END: contextvars.ContextVar = contextvars.ContextVar("nbkit_front_end", default="python")

#: Each action a message may ask for, in the words of each front end (``{name}`` fields filled by
#: :func:`fix`). The panel runs in a notebook: where it has no button for the action, the words are Python's.
FIXES = {
    "retry push": {"python": "rerun nbkit.push({path!r}, {url!r})", "shell": "run the same nbkit push command again",
                   "panel": "click Upload again"},
    "retry pull": {"python": "rerun nbkit.pull({url!r}, {path!r})", "shell": "run the same nbkit pull command again"},
    "give token": {"python": "pass storage_options={{'token': ...}}", "shell": "pass -o token=...",
                   "panel": "make the panel with WarmupPanel(ds, storage_options={{'token': ...}})"},
    "endpoint option": {"python": "storage_options['endpoint_url']", "shell": "-o endpoint_url=...",
                        "panel": "the panel's storage_options['endpoint_url']"},
    "list caches": {"python": "nbkit.caches()", "shell": "nbkit ls"},
    "remove": {"python": "nbkit.remove({path!r})", "shell": "nbkit rm {path}"},
    "free cache space": {"python": "nbkit.caches() shows the caches and what they hold; nbkit.remove(path) or "
                                   "nbkit.prune(max_bytes=...) removes them",
                         "shell": "nbkit ls shows the caches and what they hold; nbkit rm or nbkit prune removes them"},
    "remove leftovers": {"python": "nbkit.remove(path)", "shell": "nbkit rm PATH"},
    "push a cache": {"python": "nbkit.push(cache_dir, {url!r})", "shell": "nbkit push CACHE_DIR {url}",
                     "panel": "click Upload in the panel of the cache to send"},
    "export a cache": {"python": "nbkit.export_tar(cache_dir, {tar!r})", "shell": "nbkit export CACHE_DIR {tar}",
                       "panel": "click Export tar in the panel of the cache to export"},
    "import a tar": {"python": "nbkit.import_tar({tar!r}, cache_dir)", "shell": "nbkit import {tar} CACHE_DIR"},
    "get a cache again": {"python": "get it again (nbkit.pull / nbkit.import_tar), or re-create it",
                          "shell": "get it again (nbkit pull URL PATH / nbkit import TAR PATH), or remove it (nbkit rm "
                                   "PATH) and build it again"},
    "bring in a cache": {"python": "bring one in with nbkit.pull(url, path) or nbkit.import_tar(tar, path)",
                         "shell": "bring one in with nbkit pull URL PATH or nbkit import TAR PATH"},
    "show a cache": {"python": "open it with nbkit.CachedDataset.open(cache_dir)", "shell": "nbkit info CACHE_DIR shows it"},
}


def front_end() -> str:
    """Where the user is now: ``"python"`` (the default), ``"shell"`` or ``"panel"`` (see :func:`speaking_to`).

    Example:
        >>> front_end()
        'python'
        >>> with speaking_to("shell"):
        ...     front_end()
        'shell'
    """
    return _FRONT_END.get()


@contextlib.contextmanager
def speaking_to(where: str):
    """Word the fixes of messages made inside the block for ``where`` (one of :data:`FRONT_ENDS`).

    A context variable: set in the thread (or task) that runs the operation. ``nbkit.cli.main`` sets
    ``"shell"``; the panel sets ``"panel"`` inside its worker thread.

    Example:
        >>> with speaking_to("shell"):
        ...     fix("list caches")
        'nbkit ls'
        >>> fix("list caches")
        'nbkit.caches()'
    """
    if where not in FRONT_ENDS:
        raise ValueError(f"front end {where!r} is not one of {FRONT_ENDS}")
    token = _FRONT_END.set(where)
    try:
        yield where
    finally:
        _FRONT_END.reset(token)


def fix(action: str, **values) -> str:
    """The words for ``action`` (a key of :data:`FIXES`) where the user is now, ``values`` filled in.

    Example:
        >>> fix("retry push", path="/c", url="gs://b/c")
        "rerun nbkit.push('/c', 'gs://b/c')"
        >>> with speaking_to("panel"):
        ...     fix("retry push", path="/c", url="gs://b/c")
        'click Upload again'
    """
    words = FIXES[action]
    return words.get(front_end(), words["python"]).format(**values)


_quiet_lock = threading.Lock()
_quieted: dict = {}  # logger name -> [entries still open, its level before the first]


@contextlib.contextmanager
def quiet_loggers(*names: str, level: int = logging.ERROR):
    """Within the block, the loggers ``names`` (and their children that set no level of their own)
    drop records below ``level``; after it, each has its own level back. For nbkit's calls into a
    library that talks on stderr (Dask's, Ray's start and stop chatter): what matters is said in
    nbkit's words instead, and the library's errors still show. Blocks may overlap, in any threads:
    the level is restored when the last one ends.

    Example:
        >>> import logging
        >>> log = logging.getLogger("chatty")
        >>> with quiet_loggers("chatty"):
        ...     log.isEnabledFor(logging.WARNING), log.isEnabledFor(logging.ERROR)
        (False, True)
        >>> log.level == logging.NOTSET
        True
    """
    with _quiet_lock:
        for name in names:
            entry = _quieted.setdefault(name, [0, logging.getLogger(name).level])
            if entry[0] == 0:
                entry[1] = logging.getLogger(name).level
                logging.getLogger(name).setLevel(level)
            entry[0] += 1
    try:
        yield
    finally:
        with _quiet_lock:
            for name in names:
                entry = _quieted[name]
                entry[0] -= 1
                if entry[0] == 0:
                    logging.getLogger(name).setLevel(entry[1])
                    del _quieted[name]
