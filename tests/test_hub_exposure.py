"""What the class hub must not expose, checked without a hub (tests/test_jupyterhub.py
starts one and attacks it): an address beyond loopback, however it is given
(the proxy checks the final one, deploy/course_proxy.py), and the instructors'
sources, in notebooks/assignments or in the git history
(deploy/private_sources.py). One test needs root (another user tries the
files) and skips otherwise.

Run: .venv/bin/python -m pytest tests/test_hub_exposure.py   (a few seconds)
"""
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from jupyterhub.app import JupyterHub

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "deploy"))
import course_proxy  # noqa: E402
import hub_settings  # noqa: E402
import private_sources  # noqa: E402


def test_the_proxy_checks_the_address_it_is_finally_given():
    """jupyterhub applies --ip/--port/--url after the configuration file: the proxy
    (course_proxy.py) checks what it is given (a real start: test_jupyterhub.py)."""
    hub = SimpleNamespace(bind_url="http://127.0.0.1:8081/hub/")
    with pytest.raises(SystemExit, match="command-line options included:\n.*"
                       "trial mode listens on loopback only, not http://0.0.0.0:8000/"):
        course_proxy.CourseProxy(public_url="http://0.0.0.0:8000/", hub=hub, course_mode="trial")
    with pytest.raises(SystemExit,
                       match="http://0.0.0.0:443/ is not loopback: set COURSE_HUB_SSL"):
        course_proxy.CourseProxy(public_url="http://0.0.0.0:443/", hub=hub)  # class mode
    course_proxy.CourseProxy(public_url="https://0.0.0.0:443/", hub=hub, ssl_cert="c", ssl_key="k")
    course_proxy.CourseProxy(public_url="http://127.0.0.1:8000/", hub=hub, course_mode="trial")
    said = hub_settings.address_refusals("class", "https://0.0.0.0:443/", True,
                                         "http://*:8081/hub/")  # JupyterHub.hub_ip = ""
    assert said == ["the hub's own port listens on http://*:8081/hub/: keep it on 127.0.0.1 "
                    "(JupyterHub.hub_ip): it serves the login page without TLS, and only the "
                    "proxy (https://0.0.0.0:443/) is for users"]


def final_address(monkeypatch, tmp_path, *argv):
    """JupyterHub's bind_url once the trial configuration and argv are read, in the
    order JupyterHub.initialize reads them (jupyterhub 6.1.1)."""
    monkeypatch.setattr(hub_settings.os, "geteuid", lambda: 1000)
    for name in [k for k in os.environ if k.startswith("COURSE_")]:
        monkeypatch.delenv(name)
    for name, value in {"COURSE_HUB_MODE": "trial", "COURSE_HUB_STATE": str(tmp_path / "s"),
                        "COURSE_GPU_POOL": "none"}.items():
        monkeypatch.setenv(name, value)
    app = JupyterHub()
    app.parse_command_line(["-f", str(ROOT / "deploy" / "jupyterhub_config.py"), *argv])
    app.load_config_file(app.config_file)
    return app.bind_url


def test_which_command_line_options_change_the_address(monkeypatch, tmp_path):
    """--url (bind_url itself) overrides the file's address; --ip and --port do not:
    JupyterHub copies them into bind_url when they change (_url_part_changed),
    which is while the command line is parsed, before the file sets bind_url,
    and applying the same values again after the file changes nothing."""
    assert final_address(monkeypatch, tmp_path, "--ip", "0.0.0.0", "--port", "9") == \
        "http://127.0.0.1:8000"
    assert final_address(monkeypatch, tmp_path, "--url", "http://0.0.0.0:9") == "http://0.0.0.0:9"


def fake_repository(top):
    """A repository as students could meet it: a source notebook, and its history."""
    (top / "notebooks/assignments/source/a").mkdir(parents=True)
    (top / "notebooks/assignments/source/a/a.ipynb").write_text("### BEGIN SOLUTION")
    (top / ".git/objects/pack").mkdir(parents=True)
    (top / ".git/objects/pack/pack-1.pack").write_bytes(b"PACK")
    (top / ".git/HEAD").write_text("ref: refs/heads/main\n")
    return top


def test_the_instructors_sources_are_found_in_the_tree_and_the_history(tmp_path):
    clone = fake_repository(tmp_path / "clone")
    assert private_sources.git_folders(clone) == [clone / ".git"]
    main = fake_repository(tmp_path / "main")  # a worktree of it, and a borrowed store
    (main / ".git/worktrees/wt").mkdir(parents=True)
    (main / ".git/worktrees/wt/commondir").write_text("../..\n")
    (tmp_path / "wt").mkdir()
    (tmp_path / "wt/.git").write_text(f"gitdir: {main}/.git/worktrees/wt\n")
    (main / ".git/objects/info").mkdir()
    (main / ".git/objects/info/alternates").write_text(f"# borrowed\n{tmp_path}/store\n")
    assert private_sources.git_folders(tmp_path / "wt") == [
        main / ".git/worktrees/wt", main / ".git", tmp_path / "store"]
    assert private_sources.git_folders(tmp_path / "store") == []  # a copy without history
    os.chmod(clone / "notebooks/assignments", 0o700)
    assert private_sources.open_to_all(clone) == {str(clone / ".git"): str(clone / ".git")}
    said = private_sources.refusals({str(clone / ".git"): "HEAD",
                                     str(clone / "notebooks/assignments"): "x"}, "students")
    assert f"chmod 700 {clone / '.git'} (git keeps working" in said[0]
    assert said[1].endswith(f"chmod -R go-rwx {clone / 'notebooks/assignments'}")


def test_a_stand_in_student_tries_to_read_them():
    if os.geteuid() != 0:
        pytest.skip("the probe runs as another user: run as root (CI does)")
    top = Path(tempfile.mkdtemp(prefix="course-sources-"))  # /tmp, where nobody may look
    try:
        os.chmod(top, 0o755)
        clone = fake_repository(top / "clone")
        for folder in [top, *top.rglob("*")]:
            os.chmod(folder, 0o755 if folder.is_dir() else 0o644)
        nobody = hub_settings.NOBODY
        assert private_sources.readable(nobody, nobody, clone) == {
            str(clone / "notebooks/assignments"):
                str(clone / "notebooks/assignments/source/a/a.ipynb"),
            str(clone / ".git"): str(clone / ".git/HEAD")}
        os.chmod(clone / "notebooks/assignments", 0o700)
        os.chmod(clone / ".git/HEAD", 0o600)
        for folder in (".git/objects", ".git/objects/pack"):  # crossed, not listed:
            os.chmod(clone / folder, 0o711)  # a pack is still read by its name
        assert private_sources.readable(nobody, nobody, clone) == {
            str(clone / ".git"): str(clone / ".git/objects/pack/pack-1.pack")}
        os.chmod(clone / ".git", 0o700)
        assert private_sources.readable(nobody, nobody, clone) == {}
    finally:
        shutil.rmtree(top)
