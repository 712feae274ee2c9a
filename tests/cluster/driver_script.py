"""A build driver in its own process (tests/cluster/test_driver.py): ``python driver_script.py CACHE N DELAY [KILL_AT_PUT]``;
``$BUILD_BARRIER``: a directory where it says it is ready, then waits for ``go`` (drivers started together).

With ``KILL_AT_PUT`` the process dies (``os._exit(137)``, as ``kill -9``) just before the merge's
``put`` number ``KILL_AT_PUT`` (merges in small chunks, so a part is merged by several puts), or
before the merge's ``link_records`` of that number (a placed part is linked in one step).
Prints the report's ``computed`` on success."""

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nbkit
import nbkit.cluster.merge
from nbkit.cluster.engine import ExecutorEngine
from nbkit.cachedir import CacheFiles

from buildsources import Named


def main():
    path, n, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    if len(sys.argv) > 4:
        kill_at, calls = int(sys.argv[4]), [0]
        real = CacheFiles.put
        nbkit.cluster.merge.CHUNK_BYTES = 48 * 5  # five samples a put

        def put(self, *args):
            if ".parts" not in self.root:  # the cache's puts (the merge's), not the parts' (the workers')
                calls[0] += 1
                if calls[0] == kill_at:
                    os._exit(137)
            return real(self, *args)
        CacheFiles.put = put
        link = nbkit.cluster.merge.link_records

        def link_records(cache, part, **kwargs):  # a placed part's merge: records linked, no put
            calls[0] += 1
            if calls[0] == kill_at:
                os._exit(137)
            return link(cache, part, **kwargs)
        nbkit.cluster.merge.link_records = link_records
    ds = nbkit.CachedDataset(Named(n, delay=delay), path)
    barrier = os.environ.get("BUILD_BARRIER")
    if barrier:  # start building together with the other driver(s)
        open(os.path.join(barrier, f"ready-{os.getpid()}"), "w").close()
        while not os.path.exists(os.path.join(barrier, "go")):
            time.sleep(0.01)
    with ExecutorEngine(ThreadPoolExecutor(2), workers=2, name="threads") as engine:
        report = nbkit.cluster.run(ds, engine, part_size=16)
    print(report.computed, report.reused)


if __name__ == "__main__":
    main()
