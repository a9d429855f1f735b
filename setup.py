"""Build step: ship the repository's params/ and notebooks/ in the wheel as prodigy_core/_bundled/, so that a
non-editable install can run the quickstart and `prodigy-fl init` (the repository keeps the one copy;
`prodigy_core.paths.package_folder` finds either). Everything else is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
BUNDLED = {"params": "*.yaml", "notebooks": "*.ipynb"}  # folder -> files copied into prodigy_core/_bundled/


class BuildPyWithBundled(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the repository's folders
        for folder, pattern in BUNDLED.items():
            target = Path(self.build_lib) / "prodigy_core" / "_bundled" / folder
            target.mkdir(parents=True, exist_ok=True)
            for source in sorted((ROOT / folder).glob(pattern)):
                shutil.copyfile(source, target / source.name)


setup(cmdclass={"build_py": BuildPyWithBundled})
