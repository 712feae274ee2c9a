"""Crash-point tests: every operation killed at each file-system call it makes, then reopened
(``harness``, ``interpose``, ``operations``; ``docs/CRASH.md``)."""
