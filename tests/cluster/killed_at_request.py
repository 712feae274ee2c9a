"""Run one step of a gs:// build in this process and die (os._exit(137), as kill -9 leaves it) just
before its k-th request to the storage endpoint; k = 0 runs it whole. Writes the requests made, one
JSON list per line ``[method, path template, object]``, to the log file. Used by
tests/cluster/test_compose.py (the driver's compose) and tests/cluster/test_remote_build.py (a worker's
part upload).

Usage: python killed_at_request.py K LOG compose URL STORAGE_OPTIONS_JSON
       python killed_at_request.py K LOG part SPEC_PICKLE      (nbkit.cluster.part.build_part's spec, pickled by the test)
"""

import json
import os
import pickle
import sys

os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

import gcsfs


def die_before(k: int, log: str, passes=lambda method, name: False):
    """Count this process's requests to the endpoint and exit before the k-th; ``passes``: requests not counted."""
    original = gcsfs.GCSFileSystem._request
    made = []
    out = open(log, "w")

    async def request(fs, method, path, *args, **kwargs):
        name = str(kwargs.get("name") or (args[1] if len(args) > 1 else ""))
        if passes(method, name):
            return await original(fs, method, path, *args, **kwargs)
        made.append(1)
        if len(made) == k:
            out.flush()
            os._exit(137)
        out.write(json.dumps([method, path, name]) + "\n")
        out.flush()
        return await original(fs, method, path, *args, **kwargs)

    gcsfs.GCSFileSystem._request = request


def main():
    k, log, what = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if what == "compose":
        from concurrent.futures import ThreadPoolExecutor

        from nbkit.cluster.compose import compose

        url, options = sys.argv[4], json.loads(sys.argv[5])
        prefix = url.split("://", 1)[1].split("/", 1)[1].rstrip("/") + "/"
        # the hashing calls reading the composed files (threads here, workers in a build): not the driver's
        die_before(k, log, lambda method, name: method == "GET" and name.startswith(prefix) and "/" not in name[len(prefix):])
        with ThreadPoolExecutor(2) as pool:
            compose(url, storage_options=options, engine=pool)
    elif what == "part":
        from nbkit.cluster.part import build_part

        with open(sys.argv[4], "rb") as f:
            spec = pickle.load(f)
        die_before(k, log)
        result = build_part(spec)
        if result.get("storage_error") is not None:
            raise result["storage_error"]
    else:
        raise SystemExit(f"unknown step {what!r}")


if __name__ == "__main__":
    main()
