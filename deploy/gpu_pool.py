"""Share a node's GPUs out between JupyterHub users: disjoint sets, never by accident.

The hub keeps one `GPUPool`. When a user's server starts, the spawner's
`pre_spawn_hook` takes `per_user` GPUs from the pool and sets
``CUDA_VISIBLE_DEVICES`` in the server's environment to exactly those ids
(with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so an index means what ``nvidia-smi``
says), so the notebook (and every rank `labsupport` starts from it) sees only
them, as ``cuda:0``, ``cuda:1``, ... ; `post_stop_hook` gives them back. When
the pool cannot serve a request, `when_empty` decides:

- ``"refuse"`` (default): the spawn fails with a message that says how many
  GPUs are free and who holds the others;
- ``"cpu"``: the server starts with ``CUDA_VISIBLE_DEVICES=""`` (no GPU
  visible), so its ranks run on gloo on the CPU.

The pool lives in the hub's memory, and the class hub keeps users' servers
running across a hub restart (``JupyterHub.cleanup_servers = False``): the
spawner saves the ids it holds in its state, and a restarted hub gives them
back to the pool with `claim` (deploy/class_spawner.py), so a GPU held by a
running server is never lent twice. By default the pool holds every GPU of the
node by UUID (``nvidia-smi``), which no renumbering changes. The variable is
not a fence: `device_nodes` names the device files of a set of GPUs, which the
systemd spawner allows and nothing else (``DeviceAllow=``). Standard library
only: the hub does not import torch.

    pool = GPUPool(["0", "1", "2", "3"], per_user=2)
    c.Spawner.pre_spawn_hook, c.Spawner.post_stop_hook = pool.hooks()
"""
import os
import shutil
import subprocess
import threading
from pathlib import Path

WHEN_EMPTY = ("refuse", "cpu")
# Where the NVIDIA driver describes each GPU (one folder per PCI bus id).
DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")


class PoolExhausted(RuntimeError):
    """No GPUs left for a new server (with ``when_empty="refuse"``)."""


def detect_gpus():
    """UUIDs of this node's GPUs from ``nvidia-smi`` (empty without a driver)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def from_environment(environ=None):
    """A pool configured by COURSE_GPU_POOL, COURSE_GPUS_PER_USER, COURSE_GPU_WHEN_EMPTY.

    COURSE_GPU_POOL is a comma-separated list of GPU indices or UUIDs (default:
    the UUID of every GPU ``nvidia-smi`` lists); ``none`` means no GPU at all.
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

    def __deepcopy__(self, memo):
        # traitlets deep-copies config values into each spawner; every spawner
        # must share this one pool, not get a copy of it.
        return self

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

    def claim(self, owner, ids):
        """Record that owner's running server holds ids (a restarted hub's view).

        Returns the ids another owner holds too, which a caller reports: the
        running servers are the truth, so owner's set is recorded regardless.
        """
        ids = tuple(str(g) for g in ids)
        with self._lock:
            others = {g for o, held in self._held.items() if o != owner for g in held}
            self._held[owner] = ids
            return tuple(g for g in ids if g in others)

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
            spawner.environment = {**spawner.environment, "CUDA_VISIBLE_DEVICES": ",".join(ids),
                                   "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
            spawner.gpu_ids = ids  # saved in the spawner's state (class_spawner.py)
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


def device_nodes(ids, driver_gpus=None):
    """The device files (``/dev/nvidiaN``) of the GPUs named by ids: UUIDs, or
    indices in PCI bus order (``CUDA_DEVICE_ORDER=PCI_BUS_ID``, as the hooks set).

    Read from the driver's description of each GPU, which names its UUID and
    its device minor number. A GPU that cannot be found raises ValueError: a
    fence that cannot name a device must not start.
    """
    gpus = []  # (bus id, uuid, minor), in PCI bus order
    driver_gpus = Path(driver_gpus or DRIVER_GPUS)
    for folder in sorted(driver_gpus.glob("*")):
        fields = dict(line.split(":", 1) for line in (folder / "information").read_text()
                      .splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        gpus.append((folder.name, fields.get("GPU UUID"), fields.get("Device Minor")))
    nodes = []
    for gpu in ids:
        found = [minor for i, (_, uuid, minor) in enumerate(gpus) if gpu in (uuid, str(i))]
        if not found or not str(found[0]).isdigit():
            raise ValueError(f"GPU {gpu!r} is not one of the {len(gpus)} GPUs the NVIDIA driver "
                             f"describes in {driver_gpus}: check COURSE_GPU_POOL")
        nodes.append(f"/dev/nvidia{found[0]}")
    return nodes
