"""Replicas printing at the same time, run by tests/tpu/test_run.py as ``python -c <this text> DIR [nprocs] [lines]``.

Replica 0 writes half a line, then waits until replica 1 has printed its lines, then ends its line:
the exact interleaving that ran replicas' output together ("computed 8process 1 ..."). The files in
DIR are the handshake (no timing). Each replica also prints a line longer than a pipe's atomic write,
writes to stderr, and leaves a last line without its newline.
"""

import os
import sys
import time

from nbkit import tpu

DIR = sys.argv[1]
NPROCS = None if len(sys.argv) < 3 or sys.argv[2] == "all" else int(sys.argv[2])
LINES = len(sys.argv) < 4 or sys.argv[3] != "raw"


def wait_for(name):
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(DIR, name)):
        if time.monotonic() > deadline:
            raise TimeoutError(name)
        time.sleep(0.01)


def touch(name):
    open(os.path.join(DIR, name), "w").close()


def talk(index):
    import torch
    import torch_xla

    total = (torch.ones(8, device=torch_xla.device()) * (index + 1)).sum().item()
    if index == 0:
        print("replica 0 starts a line", end="", flush=True)
        touch("r0-partial")
        if NPROCS is None:
            wait_for("r1-done")
        print(f" and ends it: computed {total:g}", flush=True)
    else:
        wait_for("r0-partial")
        print(f"replica {index} computed {total:g}", flush=True)
        print(f"replica {index} line two")
        touch("r1-done")
    sys.stdout.write(f"long {index} " + "x" * 5000 + "\n")
    print(f"replica {index} to stderr", file=sys.stderr)
    print(f"replica {index} unfinished", end="")


print("parent before", flush=True)
tpu.spawn(talk, nprocs=NPROCS, lines=LINES)
print("parent after")
