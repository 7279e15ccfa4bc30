"""Everything that starts, runs and stops ranks (the public face is ``labsupport``).

- ``session``: ``ls.start``, ``ls.run``, ``ls.current``, ``ls.shutdown``: this kernel's group;
- ``cluster``: a group of ranks that runs functions sent from the notebook
  (``cluster.run(fn, timeout=)``, seconds or a ``progress.WorkDeadline``);
- ``forkserver``, ``forkserver_main``: the process server that imports torch once and
  forks ranks; ``rank_main``: one rank's loop; ``lifetime``: no orphaned process;
- ``limits``: every bound of the launcher, with its reason; ``progress``: is a run still
  working? each rank's CPU time and thread states from ``/proc`` (``WorkDeadline(stall,
  cpu, ceiling)``: the graders' runs end as a deadlock only after T s of every rank waiting
  with no CPU, as an endless loop after 3T CPU-seconds, at 30T wall seconds last);
- ``output``: each rank's stdout and stderr; ``errors``: what went wrong, in the notebook
  (with ``.reason``: deadline, stall, cpu, ceiling); ``cpu_pickle``: results on the CPU;
- ``placement``: backend, one device per rank (the GPU/NCCL placement), threads;
  ``identity``: am I a rank, and which one;
- ``strict_p2p``: ``LABSUPPORT_P2P=strict``, NCCL's point-to-point rules on gloo, installed
  by every rank (its helper threads are reused and end after 1 s idle);
- ``ipython``: the ``%%ranks`` magic; ``torchrun``: ``ls.main``, the same functions under
  torchrun.

``labsupport/README.md`` draws the round trip of ``cluster.run(fn)``. This file
imports nothing, so a module of the package may import a sibling without loading
the rest.
"""
