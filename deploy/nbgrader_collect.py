"""nbgrader's collect, trusting a submission only when its owner is its student,
and copying files only, never what a link points at.

A submission in the exchange's inbound folder is a folder named
``student+assignment+timestamp+random``. Anyone may write there (nbgrader makes
it ``733``), so anyone may create a folder that names another student.
nbgrader 0.9.6's collect compares the folder's Unix owner with the student in
its name but only logs a warning (``check_owner``,
nbgrader/exchange/default/collect.py), then collects the newest folder, so a
forged, newer folder would replace a student's real submission. With one Unix
user per student the owner is proof: here a folder not owned by the student it
names is never collected, and the newest *genuine* one is.

    nbgrader collect ASSIGNMENT --ExchangeFactory.collect=nbgrader_collect.OwnerCheckedCollect

(with deploy/ on PYTHONPATH; deploy/grade_sandboxed.py collect does this).

Links: a student owns their submission folder and may add to it after
submitting, or make a whole folder of their own; collect runs as root, and
nbgrader's copy (``shutil.copytree``) follows links, so a link to the gradebook
would come back as a copy of the gradebook, for the student's code to read when
it is graded. Here links are copied as links and then dropped, with a warning
(``nbgrader submit`` copies files, so an honest submission holds none).
"""
import os
import pwd
import shutil
from pathlib import Path

from nbgrader.exchange.default.collect import ExchangeCollect
from nbgrader.utils import ignore_patterns


class OwnerCheckedCollect(ExchangeCollect):

    def _path_to_record(self, path):
        record = super()._path_to_record(path)
        try:
            owner = pwd.getpwuid(os.lstat(path).st_uid).pw_name
        except (KeyError, OSError):
            owner = None
        record["genuine"] = owner == record["username"]
        if not record["genuine"]:
            self.log.warning("Not collected: %s names %s but belongs to %s",
                             record["filename"], record["username"], owner)
        return record

    def _sort_by_timestamp(self, records):
        # Genuine submissions first, newest first: a forged folder is picked only
        # when a student has no genuine one, and init_src then drops it.
        return sorted(records, key=lambda r: (r["genuine"], r["timestamp"]), reverse=True)

    def init_src(self):
        super().init_src()
        self.src_records = [r for r in self.src_records if r["genuine"]]

    def do_copy(self, src, dest, log=None):
        """nbgrader's copy (its size and name rules; no group sharing), links dropped."""
        if self.get_size(src) > 1000 * self.coursedir.max_dir_size:
            raise RuntimeError(f"{src} is larger than {self.coursedir.max_dir_size} kB")
        shutil.copytree(src, dest, symlinks=True, ignore=ignore_patterns(
            exclude=self.coursedir.ignore, include=self.coursedir.include,
            max_file_size=self.coursedir.max_file_size, log=self.log))
        for link in [p for p in Path(dest).rglob("*") if p.is_symlink()]:
            self.log.warning("Not collected: the link %s in %s (a submission holds files)",
                             link.relative_to(dest), src)
            link.unlink()
