"""Run nbkit.build.compose in this process and die (os._exit(137), as kill -9 leaves it) just before its
k-th request to the storage endpoint; k = 0 runs it whole. Writes the requests made, one JSON list per
line ``[method, path template, object]``, to the log file. Used by tests/build/test_compose.py.

Usage: python compose_killed.py URL STORAGE_OPTIONS_JSON K LOG
"""

import json
import os
import sys

os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

import gcsfs

from nbkit.build.compose import compose


def main():
    url, options, k, log = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    original = gcsfs.GCSFileSystem._request
    made = []
    out = open(log, "w")

    prefix = url.split("://", 1)[1].split("/", 1)[1].rstrip("/") + "/"

    async def request(fs, method, path, *args, **kwargs):
        name = str(kwargs.get("name") or (args[1] if len(args) > 1 else ""))
        if method == "GET" and name.startswith(prefix) and "/" not in name[len(prefix):]:
            # the hashing calls reading the composed files (threads here, workers in a build): not the driver's
            return await original(fs, method, path, *args, **kwargs)
        made.append(1)
        if len(made) == k:
            out.flush()
            os._exit(137)
        out.write(json.dumps([method, path, name]) + "\n")
        out.flush()
        return await original(fs, method, path, *args, **kwargs)

    gcsfs.GCSFileSystem._request = request
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as pool:  # hashing calls in threads: their reads are not counted above
        compose(url, storage_options=options, engine=pool)


if __name__ == "__main__":
    main()
