"""Calls the engine tests send to workers: module-level, so every worker process can import them."""

import os
import time


def square(x):
    return x * x


def pid():
    return os.getpid()


def hold_once(folder, seconds):
    """The first call writes its pid into ``folder`` and sleeps (the test kills it); a retry returns at once."""
    first = not os.listdir(folder)
    with open(os.path.join(folder, str(os.getpid())), "w"):
        pass
    if first:
        time.sleep(seconds)
    return "done", os.getpid()


def sleep(seconds):
    time.sleep(seconds)
    return seconds
