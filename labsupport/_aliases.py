"""Old module paths, kept working for one term after the moves of issues 33 and 41.

Assignment notebooks released before the move import ``labsupport.moe``,
``labsupport.ring_attention`` or ``labsupport.zero_bubble`` (issue 33's topic
folders), code written against ``labsupport.grading.checks``, ``.diagnosis``,
``.deadlock`` or ``.held`` (issue 41's ``labsupport/checking/``); a student's copy
cannot be re-released mid-term. Each old path below is an alias of the module
that now holds the code (the same module object, so monkeypatching and
``isinstance`` agree), installed by ``labsupport/__init__.py``:

    from labsupport import moe                        # old: still works
    from labsupport.ring_attention import lse_merge   # old: still works
    from labsupport.expert_parallel import moe        # new: use this

An old name that became a topic folder (``ring``, ``memory``, ``pipeline``,
``tensor_parallel``, ``zero``) now names the folder, which re-exports the
lesson, so ``from labsupport.ring import ring_allreduce`` keeps working too.
Remove this module after the term (``tests/test_layout.py`` lists what it serves).
"""
import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old dotted path -> new one (only paths that no longer exist)
OLD_PATHS = {
    "labsupport.memory_calc": "labsupport.memory.calc",
    "labsupport.checkpointing": "labsupport.memory.checkpointing",
    "labsupport.ddp": "labsupport.data_parallel.ddp",
    "labsupport.ddp_probe": "labsupport.data_parallel.probe",
    "labsupport.profiling": "labsupport.data_parallel.profiling",
    "labsupport.tp_gpt": "labsupport.tensor_parallel.gpt",
    "labsupport.tp_probe": "labsupport.tensor_parallel.probe",
    "labsupport.pipeline_sim": "labsupport.pipeline.sim",
    "labsupport.bubbles": "labsupport.pipeline.bubbles",
    "labsupport.zero_bubble": "labsupport.pipeline.zero_bubble",
    "labsupport.ring_attention": "labsupport.context_parallel.ring_attention",
    "labsupport.zero_args": "labsupport.zero.args",
    "labsupport.sharded_optimizer": "labsupport.zero.sharded_optimizer",
    "labsupport.mesh": "labsupport.device_mesh.mesh",
    "labsupport.planner": "labsupport.device_mesh.planner",
    "labsupport.moe": "labsupport.expert_parallel.moe",
    "labsupport.sharded_checkpoint": "labsupport.checkpoints.sharded_checkpoint",
    "labsupport.resumable": "labsupport.checkpoints.resumable",
    "labsupport.elastic": "labsupport.checkpoints.elastic",
    "labsupport.strict_p2p": "labsupport.launch.strict_p2p",
    # issue 41: the checking core left grading/ for a folder of its own, below the chapters
    "labsupport.grading.checks": "labsupport.checking.collective_checks",
    "labsupport.grading.diagnosis": "labsupport.checking.diagnosis",
    "labsupport.grading.deadlock": "labsupport.checking.deadlock",
    "labsupport.grading.held": "labsupport.checking.held",
}


def resolve(old):
    """The module an old path names now, imported (a DeprecationWarning says where)."""
    new = OLD_PATHS[old]
    warnings.warn(f"{old} moved to {new}; the old path works until the end of term",
                  DeprecationWarning, stacklevel=3)
    return importlib.import_module(new)


class _AliasLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return resolve(spec.name)

    def exec_module(self, module):
        pass                       # the new module ran already, when it was imported


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in OLD_PATHS:
            return importlib.util.spec_from_loader(fullname, _AliasLoader())
        return None


def install():
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_AliasFinder())
