"""``hvdlite.run(fn, ...)``, Horovod's programmatic launch: return values in rank order, rank errors surface."""
from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from cluster.fixtures import PYTHON, base_env

import hvdlite
import hvdlite.run as hvdrun

# The functions run in a script of their own (as a user's driver script): defined in __main__, cloudpickle
# sends them by value, exactly as with horovod.run.
DRIVER = textwrap.dedent("""
    import json, sys
    import hvdlite

    def train(scale, offset=0.0):
        import numpy as np
        import hvdlite as hvd
        hvd.init()
        total = hvd.allreduce(np.array([float(hvd.rank())]), op=hvd.Sum, name="t")
        out = {"rank": hvd.rank(), "size": hvd.size(), "value": float(total[0]) * scale + offset}
        hvd.shutdown()
        return out

    def failing(bad_rank):
        import numpy as np
        import hvdlite as hvd
        hvd.init()
        if hvd.rank() == bad_rank:
            raise KeyError(f"no shard for rank {hvd.rank()}")
        hvd.allreduce(np.ones(2), name="waits_for_the_bad_rank")
        return hvd.rank()

    n = int(sys.argv[1])
    results = hvdlite.run(train, args=(2.0,), kwargs={"offset": 0.5}, np=n)
    print("RESULTS " + json.dumps(results), flush=True)
    same = hvdlite.run.run(train, (1.0,), None, n)   # the function itself, Horovod's positional order
    print("RESULTS2 " + json.dumps(same), flush=True)
    try:
        hvdlite.run(failing, args=(n - 1,), num_proc=n)
    except KeyError as exc:
        print("CAUGHT " + json.dumps({"type": type(exc).__name__, "args": list(exc.args),
                                      "notes": getattr(exc, "__notes__", []),
                                      "cause": type(exc.__cause__).__name__,
                                      "traceback_names_rank": f"rank {n - 1} of {n}:" in str(exc.__cause__),
                                      "traceback_has_line": "raise KeyError" in str(exc.__cause__)}), flush=True)
""")


def test_run_returns_each_ranks_value_in_rank_order_and_raises_the_ranks_error(tmp_path: Path, nproc: int) -> None:
    import json
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    proc = subprocess.run([PYTHON, str(script), str(nproc)], env=base_env(), capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
             if line.startswith(("RESULTS", "CAUGHT"))}
    total = sum(range(nproc))
    assert lines["RESULTS"] == [{"rank": r, "size": nproc, "value": total * 2.0 + 0.5} for r in range(nproc)]
    assert lines["RESULTS2"] == [{"rank": r, "size": nproc, "value": float(total)} for r in range(nproc)]
    assert lines["CAUGHT"] == {"type": "KeyError", "args": [f"no shard for rank {nproc - 1}"],
                               "notes": [f"raised on rank {nproc - 1} of {nproc} in hvdlite.run"],
                               "cause": "RankError", "traceback_names_rank": True, "traceback_has_line": True}


def _square(x: int) -> int:
    return x * x


def test_run_is_the_package_and_the_function() -> None:
    assert hvdlite.run is hvdrun and callable(hvdlite.run)
    assert hvdrun.run.__module__ == "hvdlite.run.func"
    assert hvdrun.main.__module__ == "hvdlite.run"  # hvdlite-run's entry point is still there


def test_run_without_hvd_init_and_by_reference(nproc: int) -> None:
    """A function from an importable module (this test module) is pickled by reference: the ranks import it
    through the caller's import path. No hvd.init() is needed for a plain function."""
    assert hvdlite.run(_square, args=(7,), np=nproc) == [49] * nproc


@pytest.mark.parametrize("kwargs, message", [
    ({"np": 2, "num_proc": 3}, "hvdlite.run: num_proc=3 and np=2 disagree; give one of them"),
    ({"np": 2, "min_np": 1}, "hvdlite.run: min_np: no elastic form: use hvdlite-run --min-np/--max-np"),
    ({"np": 2, "max_num_proc": 4, "reset_limit": 1},
     "hvdlite.run: max_num_proc, reset_limit: no elastic form: use hvdlite-run --min-np/--max-np"),
    ({"np": 2, "use_gloo": True},
     "hvdlite.run(use_gloo=True): hvdlite-run starts the ranks with MPI only (mpiexec, mpirun or srun); Gloo in "
     "hvdlite (--check-build's \"Gloo\") is torch.distributed's gloo, which carries hvdlite.torch's CPU tensors "
     "inside that MPI job (HOROVOD_CPU_OPERATIONS=gloo), not a launcher. Drop use_gloo=True"),
    ({"np": 2, "hosts": "a:1", "hostfile": "h"}, "hvdlite.run: give hosts or hostfile, not both"),
])
def test_run_refuses_what_it_cannot_do(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        hvdlite.run(_square, args=(1,), **kwargs)
    assert str(info.value) == message


def test_rank_that_dies_without_a_result() -> None:
    import os
    with pytest.raises(RuntimeError) as info:
        hvdlite.run(os._exit, args=(3,), np=2)
    assert str(info.value).startswith("hvdlite.run: the job exited with code 3 and ranks 0, 1 returned no result")
