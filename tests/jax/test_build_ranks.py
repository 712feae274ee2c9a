"""A cache built by the processes of a real JAX job (jax.distributed on the CPU, two processes)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from nbkit.cluster.part import parts_dir

from jax_samples import child_env
from servers import free_port

HERE = Path(__file__).resolve().parent
N = 100


def test_the_ranks_of_a_jax_job_build_one_cache(tmp_path):
    port = free_port()
    cache = str(tmp_path / "shared" / "named")
    procs = [subprocess.Popen([sys.executable, str(HERE / "build_ranks.py"), cache, str(port), str(r), str(N),
                               str(tmp_path / f"rank{r}.json")], env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
    found = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [f["ranks"] for f in found] == [[0, 2], [1, 2]]  # taken from JAX: no torch.distributed in the job
    assert [f["parts"] for f in found] == [7, 7] and [f["built"] for f in found] == [4, 3]  # parts[rank::world]
    assert sum(f["computed"] for f in found) == N  # no sample computed twice
    assert [f["merged"] for f in found] == [N, 0]  # rank 0 merges, after JAX's barrier
    assert all(f["missing"] == 0 and f["verified"] == N and f["read"] == N for f in found)  # both read it whole
    assert not os.path.exists(parts_dir(cache))
