"""The same worker function runs unchanged under torchrun and from the notebook.

Run: .venv/bin/python -m pytest tests/test_torchrun.py
"""
import importlib
import json
import subprocess
import sys
import textwrap

import labsupport as ls

SCRIPT = textwrap.dedent('''
    import json, os
    import torch, torch.distributed as dist
    import labsupport as ls

    def scaled_sum(n):
        """All-reduce a rank-dependent tensor; report where it ran."""
        t = torch.arange(n, dtype=torch.float32, device=ls.device()) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "sum": t.tolist(),
                "backend": ls.backend_of(), "strict": ls.launch.strict_p2p.active()}

    if __name__ == "__main__":
        result = ls.main(scaled_sum, 4)
        with open(f"result-{os.environ['RANK']}.json", "w") as f:  # ranks share one stdout
            json.dump(result, f)
''')


def test_a_function_gives_the_same_results_under_torchrun_and_ls_run(tmp_path, monkeypatch):
    (tmp_path / "scaled_sum_script.py").write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(tmp_path / "scaled_sum_script.py")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    under_torchrun = [json.loads((tmp_path / f"result-{rank}.json").read_text())
                      for rank in range(2)]

    monkeypatch.syspath_prepend(str(tmp_path))  # the ranks import the module like torchrun does
    module = importlib.import_module("scaled_sum_script")
    from_notebook = ls.run(module.scaled_sum, 4, world_size=2)
    assert under_torchrun == from_notebook
    assert from_notebook[1] == {"rank": 1, "world_size": 2, "sum": [0.0, 3.0, 6.0, 9.0],
                                "backend": "gloo", "strict": True}  # the suite runs strict
    ls.shutdown()


def test_ls_main_outside_torchrun_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    proc = subprocess.run([sys.executable, "-c", "import labsupport as ls; ls.main(print)"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "torchrun --standalone --nproc-per-node" in proc.stderr
