"""The process server, its own side: a fresh interpreter that imports torch once and forks ranks.

The kernel starts one of these per kernel (``forkserver``, which runs
``python -m labsupport.launch.forkserver_main``).
Forking ranks from it is fast (torch is already imported, so each rank only
pays for ``init_process_group``) and safe with CUDA: this interpreter never
touches CUDA, so a rank may initialise it after the fork even when the
kernel itself already did.

It owns every rank it forked: it alone signals and reaps them, so cleanup can
never hit a process that is not ours (a PID is not reused before its reaping).
It dies with the kernel (parent-death signal, a closed control socket, or a
changed parent PID, whichever is seen first), and every rank dies with it.
"""
import os
import pickle
import select
import signal
import socket
import sys

from labsupport.launch import rank_main
from labsupport.launch.lifetime import die_with_parent
from labsupport.launch.limits import MAX_MESSAGE


class ForkServer:
    def __init__(self, ctrl: socket.socket, kernel_pid: int):
        self.ctrl = ctrl
        self.kernel_pid = kernel_pid
        self.children: dict[int, int | None] = {}  # pid -> wait status (None: alive)

    def serve(self):
        self.send("ready", os.getpid())
        while True:
            readable, _, _ = select.select([self.ctrl], [], [], 0.5)
            self.reap()
            if os.getppid() != self.kernel_pid:
                self.exit()
            if readable:
                data, fds, _, _ = socket.recv_fds(self.ctrl, MAX_MESSAGE, 64)
                if not data:  # the kernel closed its end: it is gone or done with us
                    self.exit()
                self.handle(pickle.loads(data), fds)

    def handle(self, msg, fds):
        kind = msg[0]
        if kind == "spawn":
            pids = [self.fork_rank(spec, fd, fds) for spec, fd in zip(msg[1], fds)]
            for fd in fds:  # each rank holds its own end now; ours must go, or EOF never comes
                os.close(fd)
            self.send("spawned", pids)
        elif kind == "signal":
            self.signal(msg[1], msg[2])
            self.send("signalled")
        elif kind == "kill":
            self.kill(msg[1])
            self.send("killed", {pid: self.children.pop(pid, None) for pid in msg[1]})
        elif kind == "status":
            self.reap()
            self.send("status", {pid: self.children.get(pid) for pid in msg[1]})
        elif kind == "exit":
            self.exit()

    def fork_rank(self, spec: dict, fd: int, all_fds: list[int]) -> int:
        pid = os.fork()
        if pid == 0:  # the rank: never returns into this loop
            code = 1
            try:
                for other in all_fds:
                    if other != fd:
                        os.close(other)
                self.ctrl.close()
                code = rank_main.main(fd, spec, server_pid=os.getppid())
            finally:
                os._exit(code)
        self.children[pid] = None
        return pid

    def signal(self, pids, signum):
        for pid in pids:
            if pid in self.children and self.children[pid] is None:
                os.kill(pid, signum)

    def kill(self, pids):
        self.signal(pids, signal.SIGKILL)
        for pid in pids:
            if pid in self.children and self.children[pid] is None:
                _, status = os.waitpid(pid, 0)
                self.children[pid] = status

    def reap(self):
        for pid, status in self.children.items():
            if status is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    self.children[pid] = status

    def send(self, *msg):
        self.ctrl.sendall(pickle.dumps(msg))

    def exit(self):
        self.kill(list(self.children))
        os._exit(0)


def main():
    ctrl_fd, kernel_pid, from_main_thread = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    # Started from another thread, the parent-death signal would come when that
    # thread ends; serve() checks the parent PID every 0.5 s in any case.
    die_with_parent(kernel_pid, pdeathsig=from_main_thread)
    # The kernel may catch SIGINT for its own process group; we are in our own
    # session, but ignore it anyway: only the kernel decides when ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank_main.warm_imports()
    ctrl = socket.socket(fileno=ctrl_fd)
    ForkServer(ctrl, kernel_pid).serve()


if __name__ == "__main__":
    main()
