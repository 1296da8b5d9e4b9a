"""``solar bench`` under ``mpiexec -n 2`` with a signal sent to rank 1 while rank 0 writes the bench's schedule.

    mpiexec -n 2 python tests/abort_job.py SIGNAL NAMED_TEMP bench DATA --schedule PATH ...

SIGNAL (SIGTERM or SIGINT) goes to rank 1 from inside rank 0's ``ScheduleWriter.add_epoch`` (the temporary
file open), and rank 0 then sleeps there: it is mid-write when the job ends.  NAMED_TEMP ``named`` makes
rank 0 write under a named temporary file (what file systems without ``O_TMPFILE`` get), ``unnamed`` the
default.  Each rank first makes named POSIX semaphores the way a DataLoader with forkserver workers does
(a ``forkserver`` context's queue, registered with a resource tracker) and prints them with the shared
memory segments it maps: ``abort_job: rank R shm NAME ...``.  The rest of the arguments are solar's CLI.
"""
import multiprocessing
import os
import signal
import sys
import time

from mpi4py import MPI


def shm_names():
    """The /dev/shm names of this process's MPI segments and of the semaphores made below."""
    names = set()
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if path.startswith("/dev/shm/mpich_shm_"):
                names.add(os.path.basename(path))
    return names


def main():
    sig, temp, argv = getattr(signal, sys.argv[1]), sys.argv[2], sys.argv[3:]
    comm = MPI.COMM_WORLD
    pids = comm.allgather(os.getpid())
    queue = multiprocessing.get_context("forkserver").Queue()  # kept alive to the end
    sems = {"sem." + lock._semlock.name.lstrip("/") for lock in (queue._rlock, queue._wlock, queue._sem)}
    print(f"abort_job: rank {comm.rank} shm {' '.join(sorted(shm_names() | sems))}", flush=True)
    comm.Barrier()

    import solar.atomic
    from solar.schedule import writer
    if temp == "named":
        solar.atomic.UNNAMED = False
    real = writer.ScheduleWriter.add_epoch

    def add_epoch(self, ep):
        if comm.rank == 0:
            named = getattr(self.out, "named", True)
            print(f"abort_job: rank 0 writes {self.path} (named temporary file: {named})", flush=True)
            os.kill(pids[1], sig)
            time.sleep(60)  # the job ends while the file is being written
        return real(self, ep)
    writer.ScheduleWriter.add_epoch = add_epoch
    from solar.cli import main as solar_main
    status = solar_main(argv)
    queue.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
