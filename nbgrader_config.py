# nbgrader configuration of the course's graded assignments (nbgrader==0.9.6).
# nbgrader reads this file from the directory it is run in: run every
# `nbgrader ...` command from the repository root (book/instructors.md says how).
#
# The course directory (nbgrader's CourseDirectory.root) is notebooks/assignments/:
#   source/<assignment>/<assignment>.ipynb    instructor versions, committed
#   release/, submitted/, autograded/, feedback/, gradebook.db
#                                             generated; ignored by git there
# A JupyterHub course whose files live elsewhere overrides the root on the
# command line (--CourseDirectory.root=/path) or in ~/.jupyter/nbgrader_config.py.
import os

c = get_config()  # noqa: F821 (defined by traitlets when it loads this file)

c.CourseDirectory.root = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "notebooks", "assignments")
# The name students see in `nbgrader list`; the exchange (release/collect on a
# JupyterHub) is keyed by it. Change it per course offering.
c.CourseDirectory.course_id = "distributed-training"

# Each graded cell runs the student's code on several ranks with its own
# deadline (labsupport.grading.TIMEOUT, 20 s unless $LABSUPPORT_GRADING_TIMEOUT
# says otherwise), so a deadlock fails that cell on its own: 20 s after its ranks
# all stopped progressing, however busy the machine (a slow right answer is not
# stopped; labsupport.launch.progress). nbgrader's limit per cell (default 30 s)
# is wall clock, the one limit load can reach: past it nbgrader interrupts the
# kernel and the cell scores zero. It is only the last resort (a cell that hangs
# outside the ranks), so it stays far above what a right answer's cell takes on
# a busy class hub (book/instructors.md, "Deadlocks never hang the grader").
c.Execute.timeout = 600
# Starting each notebook's kernel is wall clock too: nbgrader waits 60 s by
# default, and a class hub (or CI) grading several notebooks at once beside other
# work has taken longer than that to start one; the cell then never ran and the
# submission failed whole. Five minutes is the same last resort as above.
c.Execute.startup_timeout = 300
