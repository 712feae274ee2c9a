"""Progress callbacks: fsspec-compatible, stoppable, and a plain text line for terminals."""

import io

from fsspec.callbacks import Callback as FsspecCallback

from nbkit.progress import Callback, TextProgress, as_callback, format_seconds


def test_callback_is_an_fsspec_callback_with_a_stop_flag():
    cb = Callback()
    assert isinstance(cb, FsspecCallback)
    cb.set_size(10)
    cb.relative_update(4)
    cb.request_stop()
    assert (cb.value, cb.size, cb.stop_requested) == (4, 10, True)
    assert isinstance(as_callback(None), Callback)


def test_text_progress_prints_a_readable_line():
    out = io.StringIO()
    p = TextProgress("warmup", file=out, min_interval=0)
    p.set_size(200)
    p.relative_update(50)
    assert "50/200" in out.getvalue() and "25.0%" in out.getvalue() and "ETA" in out.getvalue()
    p.relative_update(150)
    p.close()
    assert out.getvalue().rstrip().splitlines()[-1].startswith("warmup  200/200  100.0%")


def test_text_progress_throttles():
    out = io.StringIO()
    p = TextProgress("x", file=out, min_interval=60)
    p.set_size(1000)
    for _ in range(100):
        p.relative_update(1)
    assert len(out.getvalue().splitlines()) <= 1


def test_format_seconds():
    assert format_seconds(3.21) == "3.2s" and format_seconds(75.2) == "1m15s" and format_seconds(7300) == "2h01m"
