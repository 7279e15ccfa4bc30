"""Share a node's GPUs out between JupyterHub users: disjoint sets, never by accident.

The hub keeps one `GPUPool`. When a user's server starts, the spawner's
`pre_spawn_hook` takes `per_user` GPUs from the pool and sets
``CUDA_VISIBLE_DEVICES`` in the server's environment to exactly those ids, so
the notebook (and every rank `labsupport` starts from it) sees only them, as
``cuda:0``, ``cuda:1``, ... ; `post_stop_hook` gives them back. When the pool
cannot serve a request, `when_empty` decides:

- ``"refuse"`` (default): the spawn fails with a message that says how many
  GPUs are free and who holds the others;
- ``"cpu"``: the server starts with ``CUDA_VISIBLE_DEVICES=""`` (no GPU
  visible), so its ranks run on gloo on the CPU.

The pool lives in the hub's memory. JupyterHub stops every server when the hub
stops (``JupyterHub.cleanup_servers``, on by default), so nothing is held
across a restart. Standard library only: the hub does not import torch.

    pool = GPUPool(["0", "1", "2", "3"], per_user=2)
    c.Spawner.pre_spawn_hook, c.Spawner.post_stop_hook = pool.hooks()
"""
import os
import shutil
import subprocess
import threading

WHEN_EMPTY = ("refuse", "cpu")


class PoolExhausted(RuntimeError):
    """No GPUs left for a new server (with ``when_empty="refuse"``)."""


def detect_gpus():
    """GPU indices of this node from ``nvidia-smi -L`` (empty without a driver)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def from_environment(environ=None):
    """A pool configured by COURSE_GPU_POOL, COURSE_GPUS_PER_USER, COURSE_GPU_WHEN_EMPTY.

    COURSE_GPU_POOL is a comma-separated list of GPU indices or UUIDs (default:
    every GPU ``nvidia-smi`` lists); ``none`` means no GPU at all.
    """
    env = os.environ if environ is None else environ
    spec = env.get("COURSE_GPU_POOL", "").strip()
    if spec.lower() == "none":
        gpus = []
    elif spec:
        gpus = [g.strip() for g in spec.split(",") if g.strip()]
    else:
        gpus = detect_gpus()
    per_user = env.get("COURSE_GPUS_PER_USER", "1").strip()
    if not per_user.isdigit():
        raise ValueError(f"COURSE_GPUS_PER_USER must be a whole number, got {per_user!r}")
    return GPUPool(gpus, per_user=int(per_user),
                   when_empty=env.get("COURSE_GPU_WHEN_EMPTY", "refuse").strip())


class GPUPool:
    """GPU ids handed out to owners (a user's server) in disjoint sets; thread-safe."""

    def __init__(self, gpus, per_user=1, when_empty="refuse"):
        gpus = [str(g) for g in gpus]
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"the GPU pool lists a GPU twice: {gpus}; list each id once")
        if isinstance(per_user, bool) or not isinstance(per_user, int) or per_user < 0:
            raise ValueError(f"per_user must be a whole number of GPUs, got {per_user!r}")
        if when_empty not in WHEN_EMPTY:
            raise ValueError(f"when_empty must be one of {WHEN_EMPTY}, got {when_empty!r}")
        self.gpus, self.per_user, self.when_empty = tuple(gpus), per_user, when_empty
        self._held = {}  # owner -> tuple of GPU ids
        self._lock = threading.Lock()

    def free(self):
        """GPU ids nobody holds, in pool order."""
        with self._lock:
            return self._free()

    def _free(self):
        taken = {g for ids in self._held.values() for g in ids}
        return [g for g in self.gpus if g not in taken]

    def holders(self):
        """{owner: GPU ids} of every current holder."""
        with self._lock:
            return dict(self._held)

    def acquire(self, owner):
        """The GPU ids for owner's server: its own set if it holds one, else a new one.

        Returns a tuple (empty when the pool lends no GPU: ``per_user=0``, or
        ``when_empty="cpu"`` and too few left). Raises PoolExhausted otherwise.
        """
        with self._lock:
            if owner in self._held:
                return self._held[owner]
            free = self._free()
            if len(free) >= self.per_user:
                self._held[owner] = tuple(free[:self.per_user])
                return self._held[owner]
            if self.when_empty == "cpu":
                self._held[owner] = ()
                return ()
            raise PoolExhausted(self._exhausted_message(owner, free))

    def _exhausted_message(self, owner, free):
        users = ", ".join(f"{o} ({','.join(ids)})" for o, ids in sorted(self._held.items()) if ids)
        return (f"No GPU free for {owner}: each server gets {self.per_user} GPU(s) and "
                f"{len(free)} of the {len(self.gpus)} in the pool are free (held by: "
                f"{users or 'nobody'}). Try again when someone stops their server "
                "(File > Hub Control Panel > Stop My Server), or ask the admin to set "
                "COURSE_GPU_WHEN_EMPTY=cpu to start without a GPU.")

    def release(self, owner):
        """Give owner's GPUs back; a no-op if it holds none (safe to call twice)."""
        with self._lock:
            return self._held.pop(owner, ())

    def hooks(self):
        """(pre_spawn_hook, post_stop_hook) for ``c.Spawner``."""
        def pre_spawn_hook(spawner):
            owner = owner_of(spawner)
            try:
                ids = self.acquire(owner)
            except PoolExhausted as e:
                raise refusal(str(e)) from None
            spawner.environment = {**spawner.environment, "CUDA_VISIBLE_DEVICES": ",".join(ids)}
            spawner.log.info("gpu_pool: %s gets CUDA_VISIBLE_DEVICES=%r", owner, ",".join(ids))

        def post_stop_hook(spawner):
            ids = self.release(owner_of(spawner))
            spawner.log.info("gpu_pool: %s gave back %r", owner_of(spawner), ",".join(ids))
        return pre_spawn_hook, post_stop_hook


def refusal(message):
    """JupyterHub's way to refuse a spawn: the user sees the message (HTTP 503)."""
    from jupyterhub.spawner import SpawnException
    return SpawnException(message, reason="gpu-pool", status_code=503)


def owner_of(spawner):
    """'user' for a user's default server, 'user/name' for a named server."""
    name = getattr(spawner, "name", "")
    return f"{spawner.user.name}/{name}" if name else spawner.user.name
