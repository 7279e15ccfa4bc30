"""python -m labsupport.bench hub: a whole class logging in at once to the course's hub.

N students of a temporary class (real Unix users, PAM logins) log in through
the login form and ask for their servers at the same moment, as at the start
of a lab; the course's class hub (deploy/jupyterhub_config.py: the local
spawner, one made-up GPU id per student so that ranks run on gloo, everything
else at the course's defaults) starts them, a line admitting
COURSE_SPAWNS_AT_ONCE at a time. Each student then runs a lab cell through
their kernel: a 2-rank all-reduce (kernels a few at a time, --cells-at-once).
Then the hub is killed (SIGKILL) and started again, --restarts times: after
each, what the dead hub left running is counted (its proxy is replaced by the
new hub, its idle culler must end with it) and so are the cullers running.
Last, the hub is restarted with a 20 s idle timeout and the culler's stop of
every (idle) server is timed.

Root only, like tests/test_jupyterhub.py (it creates Unix users; they, their
homes and processes are removed at the end, also on failure or SIGTERM).
Loopback only. The last line:

    hub_students=<N> hub_spawned=<n> hub_ran=<n> hub_p95_ready_s=<x> hub_orphans=<n>
    hub_services_after_restart=<n>                                  (one line)

hub_p95_ready_s counts from the moment every student starts to log in to
their server answering (login included); it is a measurement, asserted nowhere.
"""
import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

CELL = """
import json, labsupport as ls, torch, torch.distributed as dist
def reduce():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()
cluster = ls.start(world_size=2)
print(json.dumps(cluster.run(reduce, timeout=300)))
ls.shutdown()
"""
EXPECTED = [3.0, 3.0]  # ranks 0 and 1 add 1 and 2
# The last restart's settings: every server, idle since its cell, is culled at once.
CULL_NOW = {"COURSE_IDLE_TIMEOUT": "20", "COURSE_ACTIVITY_INTERVAL": "10"}
HUB_START_S = 300  # a restarted hub answers once it has checked every running server


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m labsupport.bench hub", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--students", type=int, default=16)
    p.add_argument("--restarts", type=int, default=2, help="hub kills and restarts")
    p.add_argument("--cells-at-once", type=int, default=4,
                   help="kernels running the lab cell at the same time")
    p.add_argument("--spawns-at-once", type=int, default=None,
                   help="COURSE_SPAWNS_AT_ONCE (default: the course's, the node's cores)")
    p.add_argument("--server-start-s", type=int, default=None,
                   help="COURSE_SERVER_START_S, every spawn timeout (default: the course's)")
    p.add_argument("--deadline", type=float, default=1200,
                   help="seconds for the logins, spawns and cells together")
    args = p.parse_args(argv)
    if args.students < 1 or args.restarts < 1:
        p.error("--students and --restarts must be at least 1")
    return args


def student(driver, hub_url, account, start, deadline):
    """Log in, ask for the server, follow its progress until it answers.
    (seconds from start to ready or None, API token, progress messages, error)."""
    import requests
    start.wait()
    t0 = time.monotonic()
    messages, token = [], None
    try:
        browser = driver.login_form(hub_url, account.name, account.password)
        token = driver.token_of(browser, hub_url, account.name)
        auth = {"Authorization": f"token {token}"}
        api = hub_url + f"hub/api/users/{account.name}"
        reply = requests.post(api + "/server", headers=auth, timeout=120)
        if reply.status_code not in (201, 202):
            return None, token, messages, f"POST server: HTTP {reply.status_code} {reply.text}"
        if reply.status_code == 202:  # pending: the spawn page's event stream
            with requests.get(api + "/server/progress", headers=auth, stream=True,
                              timeout=(30, max(1, deadline - time.monotonic()))) as stream:
                for line in stream.iter_lines(decode_unicode=True):
                    if line and line.startswith("data:"):
                        event = json.loads(line[5:])
                        messages.append(event.get("message", ""))
                        if event.get("ready") or event.get("failed"):
                            break
        model = requests.get(api, headers=auth, timeout=120).json()
        if not model["servers"].get("", {}).get("ready"):
            return None, token, messages, f"not ready: {messages[-1:]}"
        return time.monotonic() - t0, token, messages, None
    except Exception as e:  # one student's failure is counted, not fatal
        return None, token, messages, f"{type(e).__name__}: {e}"


async def run_cells(driver, hub_url, names_tokens, at_once, deadline):
    """Each student's lab cell through their kernel; the names whose sums were right."""
    api, gate, ran, errors = driver.Hub(hub_url), asyncio.Semaphore(at_once), [], []

    async def one(name, token):
        async with gate:
            try:
                kernel = await api.kernel(name, token)
                out = await kernel.execute(CELL, timeout=max(1, deadline - time.monotonic()))
                if driver.last_json(out) == EXPECTED:
                    ran.append(name)
                else:
                    errors.append(f"{name}: {out[-200:]}")
                kernel.ws.close()
                await api.api("DELETE", f"user/{name}/api/kernels/{kernel.id}", token)
            except Exception as e:
                errors.append(f"{name}: {type(e).__name__}: {str(e)[-300:]}")
    await asyncio.gather(*(one(n, t) for n, t in names_tokens))
    return ran, errors


def crash_and_restart(driver, hub, state, probe, **settings):
    """SIGKILL the hub, start it again: (its processes left running, the cullers
    now, the longest gap in a student's answers through the proxy meanwhile)."""
    import psutil
    import requests
    url, token = probe
    gaps, last, stop = [0.0], [time.monotonic()], threading.Event()

    def poll():  # a student's browser asking their server, through the proxy
        while not stop.is_set():
            try:
                if requests.get(url, headers={"Authorization": f"token {token}"},
                                timeout=5).status_code == 200:
                    now = time.monotonic()
                    gaps.append(now - last[0])
                    last[0] = now
            except requests.RequestException:
                pass
            time.sleep(0.05)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    time.sleep(0.5)
    old = hub.crash()
    hub.start(timeout=HUB_START_S, **settings)
    _, left = psutil.wait_procs(old, timeout=30)  # the new hub replaces the old proxy
    time.sleep(1)
    stop.set()
    poller.join()
    return left, driver.cullers(state), max(gaps)


def cull_all(hub, klass, ready, pids_of):
    """Restart the hub with a short idle timeout, which every server is past: the
    time until the culler has stopped them all (printed; a failure is printed too)."""
    try:
        hub.stop()
        started = time.monotonic()
        hub.start(timeout=HUB_START_S, **CULL_NOW)
    except AssertionError as e:
        print(f"the cull phase did not run: {str(e)[:2000]}", flush=True)
        return
    restarted = time.monotonic()
    culled = restarted + 600
    while any(pids_of(klass.accounts[s].uid) for s in ready) and time.monotonic() < culled:
        time.sleep(0.5)
    left = sum(1 for s in ready if pids_of(klass.accounts[s].uid))
    print(f"the culler stopped {len(ready) - left} idle servers of {len(ready)} in "
          f"{time.monotonic() - restarted:.1f} s after a restart with an idle timeout of "
          f"{CULL_NOW['COURSE_IDLE_TIMEOUT']} s (the hub took {restarted - started:.1f} s "
          "to start)", flush=True)


def rss_of(pid):
    import psutil
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:  # ended meanwhile
        return 0


def p95(values):
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def bench(args, klass, driver, pids_of):
    n = args.students
    names = [f"s{i:03d}" for i in range(n)]
    made = time.monotonic()
    klass.create(students=names, instructors=("ian",))
    klass.grant_python()
    klass.close_sources()
    print(f"{n} students and an instructor created in {time.monotonic() - made:.1f} s", flush=True)
    (klass.base / "run").mkdir(mode=0o700)
    state = klass.base / "state"
    env = {"COURSE_HUB_STATE": str(state), "COURSE_SPAWNER": "local",
           "COURSE_STUDENT_GROUP": klass.students_group,
           "COURSE_INSTRUCTOR_GROUP": klass.instructors_group,
           "COURSE_GPU_POOL": ",".join(map(str, range(n))), "COURSE_GPUS_PER_USER": "1",
           "COURSE_CPUS_PER_USER": "1", "PYTHONPATH": str(ROOT)}
    if args.spawns_at_once:
        env["COURSE_SPAWNS_AT_ONCE"] = str(args.spawns_at_once)
    if args.server_start_s:
        env["COURSE_SERVER_START_S"] = str(args.server_start_s)
    hub = driver.HubProcess(klass.base / "run", env)
    hub.start()
    klass.hub = hub
    deadline = time.monotonic() + args.deadline
    start = threading.Event()
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(student, driver, hub.url, klass.accounts[s], start, deadline)
                   for s in names]
        time.sleep(0.5)  # every thread waiting at the start line
        start.set()
        results = dict(zip(names, (f.result() for f in futures)))
    ready = {s: r[0] for s, r in results.items() if r[0] is not None}
    queued = [s for s, r in results.items() if any(m.startswith("Queued") for m in r[2])]
    for s, r in results.items():
        if r[3]:
            print(f"  {klass.accounts[s].name}: {r[3][:300]}", flush=True)
    if queued:
        said = next(m for m in results[queued[0]][2] if m.startswith("Queued"))
        print(f"{len(queued)} students were told they were in line, e.g.: {said}")
    rss = sum(rss_of(pid) for a in klass.accounts.values() for pid in pids_of(a.uid))
    print(f"spawned {len(ready)}/{n}; ready after (s): median "
          f"{statistics.median(ready.values()) if ready else float('nan'):.1f}, max "
          f"{max(ready.values(), default=float('nan')):.1f}; servers' RSS "
          f"{rss / 2**30:.2f} GiB in all", flush=True)
    ran, errors = asyncio.run(run_cells(driver, hub.url, [(klass.accounts[s].name, results[s][1])
                                                          for s in ready],
                                        args.cells_at_once, deadline))
    for e in errors:
        print(f"  cell: {e}", flush=True)
    print(f"{len(ran)}/{len(ready)} lab cells (2-rank all-reduce) right", flush=True)
    orphans, services = 0, 0
    first = sorted(ready)[0] if ready else None
    probe = (hub.url + f"user/{klass.accounts[first].name}/api/status" if first else hub.url,
             results[first][1] if first else "")
    for i in range(args.restarts):
        left, cullers, gap = crash_and_restart(driver, hub, state, probe)
        orphans += len(left)
        services = len(cullers)
        alive = sum(1 for a in klass.accounts.values() if pids_of(a.uid))
        print(f"restart {i + 1}: {len(left)} process(es) of the killed hub left "
              f"{[' '.join(p.cmdline()[:3]) for p in left]}, {services} culler(s) running, "
              f"students with processes: {alive}, longest gap in a student's answers "
              f"through the proxy: {gap:.2f} s", flush=True)
    cull_all(hub, klass, ready, pids_of)
    p95_s = f"{p95(ready.values()):.1f}" if ready else "nan"
    print(f"hub_students={n} hub_spawned={len(ready)} hub_ran={len(ran)} "
          f"hub_p95_ready_s={p95_s} hub_orphans={orphans} "
          f"hub_services_after_restart={services}", flush=True)


def load_driver():
    """The hub's test drivers, deploy/ (shared with tests/test_jupyterhub.py)."""
    sys.path.insert(0, str(DEPLOY))
    import hub_driver
    import temporary_class
    import uid_processes
    return hub_driver, temporary_class, uid_processes


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    if os.geteuid() != 0:
        sys.exit("the hub benchmark creates Unix users and runs the class hub with PAM "
                 "logins: run it as root (sudo .venv/bin/python -m labsupport.bench hub)")
    driver, temporary_class, uid_processes = load_driver()
    if not driver.PROXY.exists():
        sys.exit(f"{driver.PROXY} is missing: run `make proxy`")

    def terminated(signum, frame):  # SIGTERM: clean up as on Ctrl-C
        raise SystemExit(f"signal {signum}: cleaning up")
    signal.signal(signal.SIGTERM, terminated)
    klass = temporary_class.TemporaryClass()
    klass.hub = None
    try:
        bench(args, klass, driver, uid_processes.pids_of)
    finally:
        cleanup = time.monotonic()
        if klass.hub is not None and klass.hub.proc is not None:
            try:
                klass.hub.stop()
            except AssertionError as e:  # reported, and the class is removed anyway
                print(f"stopping the hub: {e}", file=sys.stderr)
        klass.remove()
        print(f"cleaned up in {time.monotonic() - cleanup:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
