"""nbkit.text: the one number formatter per quantity and the one table renderer."""

import unicodedata

import pytest

from nbkit.text import Table, format_amount, printable, format_bytes, format_count, format_percent, format_rate, format_seconds


def test_format_bytes_counts():
    assert [format_bytes(n) for n in (0, None, 999, 1000, 1_500_000, 2.5e9, 3e12)] == [
        "0 B", "0 B", "999 B", "1.0 KB", "1.5 MB", "2.5 GB", "3.0 TB"]
    assert (format_count(1234567), format_count(3.6), format_count(6667, compact=True),
            format_count(2_500_000, compact=True), format_count(500, compact=True)) == ("1,234,567", "4", "7k", "2.5M", "500")
    assert format_amount(2000, "bytes") == "2.0 KB" and format_amount(2000, "samples") == "2,000"


def test_format_rate_seconds_percent():
    assert format_rate(5400.4) == "5,400 samples/s" and format_rate(1.5e6, "bytes") == "1.5 MB/s"
    assert [format_seconds(s) for s in (0, 0.012, 3.21, 75.2, 7300)] == ["0.0s", "12ms", "3.2s", "1m15s", "2h01m"]
    assert format_seconds(3.216, digits=2) == "3.22s"
    assert (format_percent(0.756), format_percent(1.0, digits=0), format_percent(None)) == ("75.6%", "100%", "–")


def test_table_text_markdown_html():
    t = Table([("raw", 1, "2.000"), ("cached", 2, "")], header=("dataset", "epoch", "seconds"))
    assert t.text().splitlines() == ["dataset  epoch  seconds", "raw      1      2.000", "cached   2"]
    assert t.markdown().splitlines()[1:] == ["|---|---|---|", "| raw | 1 | 2.000 |", "| cached | 2 |  |"]
    page = t.html(css_class="x", row_styles=("", "font-weight:bold"))
    assert page.startswith("<table class='x'><thead><tr><th>dataset</th>") and page.count("<tr") == 3
    assert "<tr style='font-weight:bold'><td>cached</td>" in page


def test_key_value_table_with_notes_and_escaping():
    t = Table([("torch", "2.9.0"), ("a<b", "x & y")], align="ll", notes=["restart <now>"], note_prefix="warning: ")
    assert t.text() == "torch  2.9.0\na<b    x & y\nwarning: restart <now>"
    page = t.html(css_class="nbkit-runtime", row_headers=True, note_style="color:red")
    assert page.startswith("<table class='nbkit-runtime'><tr><th style='text-align:left'>torch</th>"
                           "<td style='text-align:left'>2.9.0</td></tr>")
    assert "<th style='text-align:left'>a&lt;b</th>" in page and "x &amp; y" in page
    assert page.endswith("<ul style='color:red'><li>restart &lt;now&gt;</li></ul>")
    styled = Table([(1, "note")], align="rl").html(cell_style="padding:2px", column_styles=("", "color:grey"))
    assert "<td style='padding:2px;text-align:right'>1</td><td style='padding:2px;text-align:left;color:grey'>note</td>" in styled
    with pytest.raises(ValueError, match="needs a header"):
        t.markdown()


# -- printable: what reaches a terminal (issue 25) ---------------------------------------------------

HOSTILE = ("a\x1b]0;retitled\x07b", "\x1b[2J\x1b[H", "row\nfake row", "x\r\x1b[Kover", "\x9b31m",
           "\u202egnp.exe", "\u2066iso\u2069", "zero\u200bwidth", "bell\x07", "\udcff", "line\u2028sep")


def _unsafe(text):
    return [ch for ch in text if unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Zl", "Zp")]


def test_printable_escapes_controls_and_keeps_the_rest():
    assert printable("café ✓ 数据 C:\\data") == "café ✓ 数据 C:\\data"
    assert printable("a\x1b]0;retitled\x07b") == "a\\x1b]0;retitled\\x07b"
    assert printable("row\nfake\tx\r") == "row\\nfake\\tx\\r"
    assert printable("\x9b\u202e\U000e0001\udcff") == "\\x9b\\u202e\\U000e0001\\udcff"
    assert printable(3) == "3"
    for text in HOSTILE:
        assert not _unsafe(printable(text)), text


def test_table_shows_hostile_cells_as_escapes_in_every_form():
    t = Table([(text, "1") for text in HOSTILE], header=("na\x1bme", "n"), notes=["two\nlines \x1b[2J"])
    out = t.text()
    assert not _unsafe(out.replace("\n", "")) and "\x1b" not in out
    assert len(out.splitlines()) == 1 + len(HOSTILE) + 2  # one line a row; a note keeps its own line breaks
    assert "\\x1b]0;retitled\\x07" in out and "\\u202egnp.exe" in out and "two\nlines \\x1b[2J" in out
    assert not _unsafe(t.markdown().replace("\n", ""))
    page = t.html()
    assert not _unsafe(page.replace("\n", "")) and "\\u202egnp.exe" in page  # escaped, then HTML-escaped
    assert "<script>" not in Table([("<script>\x1b",)], notes=["<b>"]).html()


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given
from hypothesis import strategies as st


@pytest.mark.fuzz
@given(st.text(st.characters() | st.characters(categories=["Cs"]) | st.sampled_from("\x1b\x9b\n\r\t\u202e\\["),
               max_size=64))
def test_fuzz_printable_has_no_control_or_format_characters_and_reads_back(text):
    out = printable(text)
    assert not _unsafe(out)
    assert printable(out) == out  # applying it twice (a table of printed text) changes nothing
    if "\\" not in text:  # without backslashes of its own, the escapes read back to the very text
        assert out.encode("latin-1", "backslashreplace").decode("unicode_escape") == text


# -- counts, ages and paths as people read them ------------------------------------------------------


def test_plural_and_age():
    from nbkit.text import format_age, plural

    assert [plural(n, "cache") for n in (0, 1, 2)] == ["0 caches", "1 cache", "2 caches"]
    assert format_age(240 * 3600 + 60) == "10 days ago" and format_age(3 * 3600) == "3 hours ago"
    assert format_age(5400) == "90 minutes ago" and format_age(-5) == "0s ago"  # a clock set back: never "-5s"


# -- fixes worded for where the user is -----------------------------------------------------------------


def test_every_action_has_words_for_python_and_the_shell_and_the_panel_falls_back_on_python():
    from nbkit.text import FIXES, FRONT_ENDS

    for action, words in FIXES.items():  # the panel may fall back on Python's words (it runs in a notebook)
        assert {"python", "shell"} <= set(words) <= set(FRONT_ENDS), action


def test_the_front_end_picks_the_words_and_is_set_per_thread():
    import threading

    import pytest

    from nbkit.text import fix, front_end, speaking_to

    assert front_end() == "python" and fix("give token") == "pass storage_options={'token': ...}"
    with speaking_to("shell"):
        assert fix("give token") == "pass -o token=..." and fix("list caches") == "nbkit ls"
        assert fix("retry push", path="/c", url="gs://b/c") == "run the same nbkit push command again"
        seen = []
        t = threading.Thread(target=lambda: seen.append(front_end()))  # a new thread starts from the default
        t.start()
        t.join()
        assert seen == ["python"]
    with speaking_to("panel"):
        assert fix("retry push", path="/c", url="gs://b/c") == "click Upload again"
    assert front_end() == "python"
    with pytest.raises(ValueError, match="front end 'web'"):
        with speaking_to("web"):
            pass


def test_remote_errors_name_the_fix_for_the_front_end():
    from nbkit.transfer.remote import classify
    from nbkit.text import speaking_to

    refused = ConnectionRefusedError(111, "refused")
    assert "storage_options['endpoint_url']" in str(classify(refused, None, "gs://b/c", "pushing to", "rerun"))
    with speaking_to("shell"):
        assert "-o endpoint_url=..." in str(classify(refused, None, "gs://b/c", "pushing to", "rerun"))


def test_a_panel_operation_runs_speaking_to_the_panel_in_its_worker_thread(tmp_path):
    import pytest

    pytest.importorskip("ipywidgets")
    from unittest import mock

    import torch

    import nbkit
    from nbkit.text import fix
    from nbkit.widgets import WarmupPanel

    ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(8)), str(tmp_path / "c"))
    ds.warmup()

    def failing_push(root, url, **kwargs):  # fails as a real push does, naming the fix where it runs
        raise OSError(f"push to {url} failed; to try again, {fix('retry push', path=root, url=url)}")

    panel = WarmupPanel(ds, upload_url="memory://nbkit-text-test/c")
    with mock.patch("nbkit.transfer.push", failing_push):
        panel.upload_button.click()
        assert panel.wait(timeout=60)
    assert str(panel.error("upload")).endswith("to try again, click Upload again")


def test_say_in_a_notebook_leaves_room_in_the_classic_notebooks_400_px_output(monkeypatch, capsys):
    """The classic Notebook shows 28 columns of printed text at 400 px (tests/test_browser.py measures
    it); say() fills two fewer, so "there", "60,000" and "188.6 MB" are never broken there."""
    import nbkit.text as text

    assert text.NARROW_COLUMNS == 26
    monkeypatch.setattr(text, "in_kernel", lambda: True)
    said = "cache complete: True (60,000 of 60,000 samples, 188.6 MB); there is nothing left to compute"
    text.say(said)
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 26 and " ".join(lines) == said, lines


def test_quiet_loggers_overlapping_in_threads_restore_the_level_once_the_last_ends():
    import logging
    import threading

    from nbkit.text import quiet_loggers

    log = logging.getLogger("nbkit-test-chatty")
    log.setLevel(logging.INFO)
    inside, release = threading.Event(), threading.Event()

    def other():
        with quiet_loggers("nbkit-test-chatty"):
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(10)
    with quiet_loggers("nbkit-test-chatty"):
        assert not log.isEnabledFor(logging.WARNING) and log.isEnabledFor(logging.ERROR)
    assert log.level == logging.ERROR  # the other block is still open: still quiet
    release.set()
    t.join(10)
    assert log.level == logging.INFO  # its own level back, once
