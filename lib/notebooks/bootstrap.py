"""What the notebooks' first cell does, so that the cell stays a few lines: on Colab, bring the
cloned repository to the requested branch and install it as `make setup` does
(`install_colab_checkout`); in a local checkout, check that it is the one installed
(`local_checkout`). Standard library only: on Colab it runs (`runpy`) before anything is installed.
"""

from __future__ import annotations

import site
import subprocess
import sys
import sysconfig
from pathlib import Path


def install_colab_checkout(root: Path, repo_url: str, ref: str) -> Path:
    """Check `ref` of `repo_url` out in the clone at `root` (a re-run of the cell updates it in
    place), `pip install -e` it with the plotting extras, and make the editable install importable
    in this kernel without a restart. Returns `root`."""
    subprocess.run(["git", "-C", str(root), "fetch", "--quiet", repo_url, ref], check=True)
    subprocess.run(["git", "-C", str(root), "checkout", "--quiet", "--detach", "FETCH_HEAD"], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "-e", f"{root}[plot]"], check=True)
    site.addsitedir(sysconfig.get_paths()["purelib"])  # the editable install's .pth, read now
    return Path(root)


def local_checkout() -> Path:
    """The repository root of the installed `lib` (configs/, evidence/, requirements-gpu.txt live
    there); an error that says what to do when `lib` is installed from elsewhere."""
    import lib

    root = Path(lib.__file__).resolve().parents[1]
    if not (root / "notebooks").is_dir():
        raise RuntimeError(f"lib is installed from {root}, not from a checkout: `pip install -e` the repository")
    return root
