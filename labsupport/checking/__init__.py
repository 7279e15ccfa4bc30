"""The checking core: a student's function run on several ranks, checked, and failed helpfully.

What every chapter's your-turn check and every assignment's grader is built on
(an instrument, below the chapters: ``grading/`` holds only the graders):

- ``collective_checks``: ``check_allreduce``, ``check_reduce_scatter``,
  ``check_all_gather`` (a student's collective against torch's, and its bytes),
  ``run`` (any function on the ranks, its calls recorded), ``assert_rules``;
- ``diagnosis``: running on the ranks with a deadline (``TIMEOUT``, a stall of
  the ranks' CPU time, not a flat wall clock: ``launch.progress``) and turning
  an exception or a hang into advice; ``name_of``;
- ``deadlock``: which message each stuck rank waited for, from its ``p2p_log``;
- ``held``: what a student's code holds by reference, the memory count of
  assignments 4 and 5 (the same under any load, unlike a tally of live storages).
"""
