"""What the students' kernels run in tests/test_jupyterhub.py: ranks started and
all-reduced at the same moment by two students, and student A's attacks on
student B, on the hub, and on the grader. Each attack is a list of attempts,
each reported as ``[what, "denied: ..."]`` or ``[what, "ALLOWED: ..."]``; the
test asserts that every one was denied.
"""
import json

import nbformat

START = """
import json, os, sys, time
import labsupport as ls
import torch.distributed as dist
while not os.path.exists({go!r}):
    time.sleep(0.01)
cluster = ls.start(world_size=2)
cluster.run(dist.barrier)
print(json.dumps({{"kernel": os.getpid(), "ranks": cluster.pids, "python": sys.executable,
                  "labsupport": ls.__file__, "backend": cluster.backend, "uid": os.getuid(),
                  "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                  "cpus": os.environ.get("LABSUPPORT_CPUS")}}))
"""

# Ten all-reduces over about half a second, so the two students' runs overlap.
ALLREDUCE = """
while not os.path.exists({go!r}):
    time.sleep(0.01)
def allreduce(tag):
    import time, torch, torch.distributed as dist
    start = time.time()
    for _ in range(10):
        t = torch.tensor([float(dist.get_rank() + tag)])
        dist.all_reduce(t)
        time.sleep(0.05)
    return t.item(), start, time.time()
print(json.dumps(cluster.run(allreduce, {tag}, timeout=60)))
"""

STILL_REDUCES = """
def still_reduces():
    import torch, torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()
print(json.dumps(cluster.run(still_reduces, timeout=60)))
"""

# Shared by every attack: run one attempt and say whether it was denied.
ATTEMPT = """
import errno, json, os, signal, subprocess, urllib.error, urllib.request
results = []
class GitRefused(Exception):
    pass
def attempt(what, action):
    try:
        got = action()
    except GitRefused as e:  # the test checks git's words and that root's git reads it
        verdict = f"denied: {e}"
    except urllib.error.HTTPError as e:  # the test checks the code of each, and that the
        # owner gets 200 from the same URL
        verdict = (f"denied: HTTP {e.code}" if e.code in (401, 403, 404)
                   else f"ALLOWED? HTTP {e.code}")
    except urllib.error.URLError as e:  # no way to the address (the test checks it exists)
        verdict = f"denied: {e.reason}"
    except (PermissionError, FileNotFoundError, MemoryError, BlockingIOError) as e:
        verdict = f"denied: {type(e).__name__}"  # the test checks that the files exist
    except (ConnectionRefusedError, OSError) as e:
        no_way = e.errno in (errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH)
        verdict = f"denied: {e.strerror}" if no_way else f"ALLOWED? {type(e).__name__}: {e}"
    except Exception as e:
        verdict = f"ALLOWED? {type(e).__name__}: {e}"
    else:
        verdict = f"ALLOWED: {str(got)[:120]}"
    results.append([what, verdict])
def get(url, token=None):
    headers = {"Authorization": f"token {token}"} if token else {}
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30).read()
def readable(path):
    with open(path, "rb") as f:
        return f.read()
def git_show(repo, path):  # as anyone would: git trusts no repository of another's
    done = subprocess.run(["git", "-c", "safe.directory=*", "-C", repo, "show", "HEAD:" + path],
                          capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise GitRefused("git: " + (done.stderr.strip().splitlines() or ["(nothing)"])[0])
    return done.stdout
def through_git(t):  # the instructors' notebook from the history, then its files
    attempt("git show HEAD:" + t["source"], lambda: git_show(t["repo"], t["source"]))
    attempt("list the git objects", lambda: os.listdir(t["objects"]))
    for path in t["files"]:
        attempt(f"read {path}", lambda path=path: readable(path))
"""
ATTEMPT_ = ATTEMPT.replace("{", "{{").replace("}", "}}")  # inside a str.format template

# Student A against student B and the hub, from A's kernel; t holds B's pids,
# paths and ports (the test, as root, knows them; A could find most in /proc).
PEER = ATTEMPT_ + """
t = json.loads({targets!r})
mine = os.environ["JUPYTERHUB_API_TOKEN"]
attempt("list B's home", lambda: os.listdir(t["home"]))
attempt("read B's shell profile", lambda: readable(t["home"] + "/.profile"))
attempt("read B's kernel connection file", lambda: readable(t["connection_file"]))
attempt("read B's server log", lambda: readable(t["home"] + "/.course-hub/server.log"))
for pid in t["pids"]:
    attempt(f"read B's /proc/{{pid}}/environ", lambda pid=pid: readable(f"/proc/{{pid}}/environ"))
for pid in t["hub_pids"]:  # the hub's and the proxy's: the proxy's token is there
    attempt(f"read the hub's /proc/{{pid}}/environ",
            lambda pid=pid: readable(f"/proc/{{pid}}/environ"))
for path in t["hub_files"]:
    attempt(f"read {{path}}", lambda path=path: readable(path))
attempt("list the hub's state folder", lambda: os.listdir(t["state"]))
attempt("read the instructors' assignments", lambda: os.listdir(t["assignments"]))
through_git(t["git"])
attempt("proxy API without its token", lambda: get(t["proxy_api"]))
attempt("proxy API with A's token", lambda: get(t["proxy_api"], mine))
attempt("B's server API with A's token, straight to its port",
        lambda: get(t["server_direct"], mine))
attempt("B's server API with A's token, through the proxy", lambda: get(t["server_proxied"], mine))
attempt("the hub's API for B with A's token", lambda: get(t["hub_user"], mine))
for pid in t["pids"]:
    attempt(f"SIGKILL B's process {{pid}}", lambda pid=pid: os.kill(pid, signal.SIGKILL))
import socket
for port in t["rank_ports"]:  # gloo accepts anyone's connection: garbage must not break B
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(os.urandom(4096))
seen = ""
for pid in os.listdir("/proc"):  # every command line and environment A may read
    for part in ("cmdline", "environ"):
        try:
            seen += readable(f"/proc/{{pid}}/{{part}}").decode(errors="replace")
        except OSError:
            pass
def absent(secret):
    if secret in seen:
        return "found"
    raise PermissionError("in nothing A can read")
for name, secret in t["secrets"].items():
    attempt(f"find {{name}} in what /proc shows A", lambda secret=secret: absent(secret))
print(json.dumps(results))
"""

# A sends an execute_request to B's kernel's shell port, signed with a key of
# her own: B's kernel must drop it (the key is in B's connection file only).
INJECT = """
import time
from jupyter_client import BlockingKernelClient
t = json.loads({targets!r})
client = BlockingKernelClient(ip="127.0.0.1", key=b"not-bobs-key", **t["ports"])
client.start_channels()
client.execute(f"open({{t['marker']!r}}, 'w').write('code of A ran in B kernel')")
time.sleep(2)
client.stop_channels()
print("sent")
"""


def tiny_assignment(path, marker):
    """A graded notebook of one answer and two test cells: one with a hidden test
    that carries marker (grading must never let a student's code read it), one
    that runs the answer on 2 labsupport ranks (the labs work in the sandbox)."""
    def cell(source, **nbgrader):
        return nbformat.v4.new_code_cell(source, metadata={"nbgrader": {
            "schema_version": 3, "locked": False, "solution": False, "grade": False,
            **nbgrader}})
    nb = nbformat.v4.new_notebook(cells=[
        cell("def square(x):\n    ### BEGIN SOLUTION\n    return x * x\n    ### END SOLUTION",
             grade_id="answer", solution=True),
        cell("assert square(3) == 9\n### BEGIN HIDDEN TESTS\n"
             f"assert square(12) == 144, {marker!r}\n### END HIDDEN TESTS",
             grade_id="test_square", grade=True, points=2, locked=True),
        cell("import labsupport as ls\n"
             "assert ls.run(lambda: square(3), world_size=2, backend='gloo') == [9, 9]",
             grade_id="test_on_ranks", grade=True, points=1, locked=True)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (course)",
                                 "language": "python"}
    path.parent.mkdir(parents=True)
    nbformat.write(nb, path)


# A student fetches the assignment, writes an answer into its answer cell and submits.
SUBMIT = """
import json, os, subprocess, sys
exchange = {options!r}
def nbgrader(*args):
    done = subprocess.run([sys.executable, "-m", "nbgrader", *args, "tiny", *exchange],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
nbgrader("fetch_assignment")
path = os.path.expanduser("~/tiny/tiny.ipynb")
nb = json.load(open(path))
answer, = [c for c in nb["cells"] if c["metadata"].get("nbgrader", {{}}).get("solution")]
answer["source"] = {answer!r}
json.dump(nb, open(path, "w"))
nbgrader("submit")
print("submitted")
"""

# Alice, once her own submission is in, writes into the exchange's inbound
# folder (open to all, by nbgrader's design) two newer "submissions": one in
# bob's name with a wrong answer, and one of her own holding links to the
# gradebook and the source notebook, for collect (root) to copy.
FORGE = """
import json, os
nb = json.load(open(os.path.expanduser("~/tiny/tiny.ipynb")))
def plant(student, wrong, links):
    folder = {inbound!r} + "/" + student + "+tiny+2099-01-01 00:00:00.000000 UTC+planted"
    os.makedirs(folder)
    for c in nb["cells"]:
        if wrong and c["metadata"].get("nbgrader", {{}}).get("solution"):
            c["source"] = "def square(x):\\n    return 0"
    json.dump(nb, open(folder + "/tiny.ipynb", "w"))
    open(folder + "/timestamp.txt", "w").write("2099-01-01 00:00:00.000000 UTC")
    for name, target in links.items():
        os.symlink(target, folder + "/" + name)
plant({alice!r}, False, {links!r})
plant({bob!r}, True, {{}})
print("planted")
"""

# Alice's answer: right, and then, while the grader runs it, an attack on the
# grader (paths from the test): every attempt's verdict goes to the output.
GRADED_ATTACK = ATTEMPT_ + """
def square(x):
    return x * x
t = {targets}
for what, path in t["files"].items():
    attempt(f"read {{what}}", lambda path=path: readable(path))
for what, path in t["folders"].items():
    attempt(f"list {{what}}", lambda path=path: os.listdir(path))
for what, url in t["urls"].items():
    attempt(f"reach {{what}}", lambda url=url: get(url))
marker = t["marker_reversed"][::-1]  # not in this cell's source, which the kernel keeps
import stat, time
def software(folder, name):  # a virtual environment or JS packages: the course's code, no secret
    return name == "node_modules" or os.path.exists(os.path.join(folder, name, "pyvenv.cfg"))
def find_marker():  # every regular file of a notebook's or a gradebook's size, within 20 s
    started, seen = time.monotonic(), 0
    for top in (".", "..", "/tmp", "/var/tmp", "/dev/shm", os.path.expanduser("~")):
        for folder, folders, files in os.walk(top):
            folders[:] = [f for f in folders if not software(folder, f)]
            for name in files:
                path = os.path.join(folder, name)
                try:
                    info = os.stat(path)
                    if not stat.S_ISREG(info.st_mode) or info.st_size > 16 << 20:
                        continue
                    seen += 1
                    if marker.encode() in readable(path):
                        return path
                except OSError:
                    pass
                if time.monotonic() - started > 20:
                    raise TimeoutError(f"the search read {{seen}} files in 20 s without finishing "
                                       f"(now in {{folder}}): make it skip what holds no secret")
    raise PermissionError("not found")
attempt("find the hidden test's text in any file within reach", find_marker)
through_git(t["git"])
attempt("reach the internet", lambda: __import__("socket").create_connection(("1.1.1.1", 80), 5))
attempt("allocate twice the memory limit", lambda: bytearray(2 * t["memory"]))
import subprocess
children = []
def spawn_many():
    for _ in range(t["processes"] + 8):
        children.append(subprocess.Popen(["sleep", "30"]))
attempt("start more processes than the limit", spawn_many)
for child in children:
    child.kill()
    child.wait()  # reaped: a zombie still counts against the limit
subprocess.Popen(["sleep", "600"], start_new_session=True)  # left behind, on purpose
open("/tmp/" + t["planted"], "w").write("for the next submission")
print("ATTACK-RESULTS " + json.dumps(results))
"""


def graded_attack(targets):
    """The source of alice's answer cell."""
    return GRADED_ATTACK.format(targets=json.dumps(targets))
