"""deploy/z2jh-values.yaml, the Kubernetes deployment, parsed and checked. No
cluster ran it here (none is available to this project): this checks the keys
an instructor relies on, not that the chart renders or pods schedule.

Run: .venv/bin/python -m pytest tests/test_z2jh_values.py
"""
import re
from pathlib import Path

import yaml

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
