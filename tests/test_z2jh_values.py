"""deploy/z2jh-values.yaml, the Kubernetes deployment, parsed and checked, and
the .dockerignore of its image. No cluster ran it here (none is available to
this project): this checks the keys an instructor relies on, and runs the two
hub.extraConfig snippets the way the chart's hub runs them (on the ``c`` that
holds hub.config, with z2jh's ``get_config`` reading these values): the hub
refuses to start until the login, the admins and HTTPS are set, and the 4- and
8-GPU profiles are offered to instructors only. Not that the chart renders or
pods schedule.

Run: .venv/bin/python -m pytest tests/test_z2jh_values.py
"""
import copy
import re
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from traitlets.config import Config

ROOT = Path(__file__).resolve().parent.parent
VALUES = yaml.safe_load((ROOT / "deploy" / "z2jh-values.yaml").read_text())
UNITS = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def quantity(text):
    """A Kubernetes memory quantity ('16Gi', '64G') in bytes."""
    number, unit = re.fullmatch(r"(\d+)([KMG]i?)?", str(text)).groups()
    return int(number) * UNITS[unit or ""]


def test_profiles_of_1_2_4_and_8_gpus_each_with_cores_and_memory_for_its_ranks():
    profiles = VALUES["singleuser"]["profileList"]
    gpus = [int(p["kubespawner_override"]["extra_resource_limits"]["nvidia.com/gpu"])
            for p in profiles]
    assert gpus == [1, 2, 4, 8]
    assert [p.get("default", False) for p in profiles] == [True, False, False, False]
    for p, n in zip(profiles, gpus):
        over = p["kubespawner_override"]
        assert over["cpu_guarantee"] >= 2 * n, f"{p['slug']}: at least 2 cores per GPU rank"
        assert quantity(over["mem_limit"]) >= quantity(over["mem_guarantee"])
    assert len({p["slug"] for p in profiles}) == 4


def test_dev_shm_is_a_memory_emptydir_large_enough_for_nccl_within_every_profile():
    storage = VALUES["singleuser"]["storage"]
    volume, = [v for v in storage["extraVolumes"] if v["name"] == "dshm"]
    mount, = [m for m in storage["extraVolumeMounts"] if m["name"] == "dshm"]
    assert mount["mountPath"] == "/dev/shm"
    assert volume["emptyDir"]["medium"] == "Memory"
    size = quantity(volume["emptyDir"]["sizeLimit"])
    assert size >= 2**30, "NCCL needs more than Docker's 64 MiB: 1 GiB at least"
    for p in VALUES["singleuser"]["profileList"]:
        assert size <= quantity(p["kubespawner_override"]["mem_limit"]), \
            f"{p['slug']}: /dev/shm counts against the pod's memory limit"


def test_the_course_image_and_kernel_are_named():
    image = VALUES["singleuser"]["image"]
    assert image["name"] and isinstance(image["tag"], str)
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert f"-t {image['name']}:{image['tag']}" in dockerfile
    assert "requirements.txt" in dockerfile and '"Python 3 (course)"' in dockerfile
    assert VALUES["singleuser"]["defaultUrl"] == "/lab"
    assert VALUES["cull"]["enabled"] is True, "idle servers give their GPUs back"
    assert VALUES["cull"]["timeout"] <= 3600 and VALUES["cull"]["every"] <= 600
    culling, = VALUES["singleuser"]["extraFiles"].values()
    assert culling["mountPath"] == "/etc/jupyter/jupyter_server_config.json"
    assert culling["data"]["MappingKernelManager"] == {
        "cull_idle_timeout": 1800, "cull_interval": 180, "cull_connected": True,
        "cull_busy": False}, "an abandoned tab's kernel, and its ranks, end"


def lookup(values, key, default=None):
    """z2jh's get_config (jupyterhub/files/hub/z2jh.py): a dotted path into the values."""
    for level in key.split("."):
        if not isinstance(values, dict) or level not in values:
            return default
        values = values[level]
    return values


def hub_config(values, monkeypatch):
    """Run the values' hub.extraConfig snippets in order, as the chart's
    jupyterhub_config.py does after loading hub.config and the profile list."""
    c = Config()
    for section, cfg in values["hub"]["config"].items():
        c[section].update(copy.deepcopy(cfg))
    c.KubeSpawner.profile_list = values["singleuser"]["profileList"]
    monkeypatch.setitem(sys.modules, "z2jh", types.SimpleNamespace(
        get_config=lambda key, default=None: lookup(values, key, default)))
    for name, snippet in sorted(values["hub"]["extraConfig"].items()):
        exec(compile(snippet, name, "exec"), {"c": c})
    return c


def configured(values):
    """The values with every REPLACE-ME filled in, as an instructor would."""
    done = copy.deepcopy(values)
    done["hub"]["config"]["JupyterHub"]["authenticator_class"] = "github"
    done["hub"]["config"]["Authenticator"]["admin_users"] = ["ian"]
    done["proxy"]["https"]["hosts"] = ["hub.uni.example"]
    return done


def test_the_hub_refuses_to_start_until_login_admins_and_https_are_set(monkeypatch):
    with pytest.raises(SystemExit) as refused:
        hub_config(VALUES, monkeypatch)
    said = str(refused.value)
    assert "authenticator_class is 'REPLACE-ME'" in said
    assert "admin_users: name your instructors" in said and "proxy.https" in said
    hub_config(configured(VALUES), monkeypatch)  # starts
    for change, words in (
            (lambda v: v["hub"]["config"]["JupyterHub"].update(authenticator_class="dummy"),
             "authenticator_class is 'dummy'"),
            (lambda v: v["hub"]["config"]["Authenticator"].update(allow_all=True), "allow_all"),
            (lambda v: v["proxy"]["https"].update(enabled=False), "HTTPS must be on")):
        values = configured(VALUES)
        change(values)
        with pytest.raises(SystemExit, match=words):
            hub_config(values, monkeypatch)
    assert VALUES["proxy"]["https"]["enabled"] is True
    assert "allow_all" not in VALUES["hub"]["config"]["Authenticator"]


def test_profiles_of_4_and_8_gpus_are_for_instructors_only(monkeypatch):
    profiles = hub_config(configured(VALUES), monkeypatch).KubeSpawner.profile_list

    def offered(admin=False, groups=()):
        user = SimpleNamespace(admin=admin, groups=[SimpleNamespace(name=g) for g in groups])
        return [p["slug"] for p in profiles(SimpleNamespace(user=user))]
    assert offered() == ["gpu-1", "gpu-2"], "a student sees 1 and 2 GPUs"
    assert offered(groups=["instructors"]) == ["gpu-1", "gpu-2", "gpu-4", "gpu-8"]
    assert offered(admin=True) == ["gpu-1", "gpu-2", "gpu-4", "gpu-8"]


def docker_ignored(path, patterns):
    """Whether docker build leaves path out of the context: a pattern (Go's
    filepath.Match, plus ** for any folders) matching the path or a folder above
    it excludes it, a later !pattern takes it back."""
    def regex(pattern):
        out = re.escape(pattern.strip("/")).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
        return out.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
    prefixes = ["/".join(path.split("/")[:i]) for i in range(1, path.count("/") + 2)]
    ignored = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        if any(re.fullmatch(regex(pattern.lstrip("!")), p) for p in prefixes):
            ignored = not keep
    return ignored


def test_the_image_gets_no_secret_no_solution_and_no_local_build():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    left_out = [".git/config", ".venv/bin/python", "_build/html/index.html",
                "labsupport/__pycache__/x.pyc", "jupyterhub_cookie_secret",
                "deploy/jupyterhub.sqlite", "state/jupyterhub.sqlite-journal",
                "notebooks/assignments/source/dp_tp_step/dp_tp_step.ipynb",
                "notebooks/assignments/gradebook.db", "notebooks/assignments/submitted/a/x.ipynb",
                "tests/grading_rings.py", "deploy/proxy/node_modules/x.js"]
    kept = ["labsupport/__init__.py", "requirements.txt", "pyproject.toml",
            "notebooks/00_how_this_book_runs.ipynb", "deploy/Dockerfile", "book/jupyterhub.md"]
    assert [p for p in left_out if not docker_ignored(p, patterns)] == []
    assert [p for p in kept if docker_ignored(p, patterns)] == []
    assert "COPY --chown=${NB_UID}:${NB_GID} . /opt/course" in (
        ROOT / "deploy" / "Dockerfile").read_text(), "the context is the repository root"
