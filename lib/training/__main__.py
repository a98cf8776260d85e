"""`python -m lib.training [--config FILE.yaml] [--FIELD VALUE ...]`: one GRPO run.

With no arguments it runs the default CPU training (`TrainConfig()`). Every `TrainConfig`
field is a typed flag (`--max_steps 10`, `--help` lists them with their meaning); a config
file (YAML or JSON) holds field names, and flags override it (`lib.training.cli`):
configs/train/smoke.yaml is a whole run in minutes on 2 cores, default.yaml the default run,
colab.yaml a real model on one GPU. The result (timings, before/after metrics) is printed as
JSON and written to `<output_dir>/train_result.json`.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

from lib.extras import require
from lib.files import DiskFullError, FolderLockedError, atomic_write, json_text
from lib.progress import headless
from lib.training.cli import parse_train_config, train_config_parser

QUIET_LIBRARIES = {
    "TRL_EXPERIMENTAL_SILENCE": "1",  # TRL's notice that rollout_func is experimental, at every run
}
"""Set for a command-line run (unless already set): libraries' notices to developers, not users."""


STOPS = (DiskFullError, FolderLockedError, NotADirectoryError, PermissionError, FileNotFoundError, ModuleNotFoundError)
"""What stops a run before or during its work with a message written to be read as it is (a full
disk, a folder another run holds, an output folder that cannot be written, a checkpoint to resume
that is not there, TensorBoard missing): one line, no traceback."""


def main(argv=None) -> int:
    for name, value in QUIET_LIBRARIES.items():
        os.environ.setdefault(name, value)
    if headless():  # transformers' and the Hub's own bars (loading weights, writing shards) in a log file
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)  # libraries' deprecations, for their developers
    parser = train_config_parser(description=__doc__, argv=argv)
    if not {"-h", "--help"} & set(sys.argv[1:] if argv is None else argv):
        try:
            require("train", "training")
        except ModuleNotFoundError as error:
            parser.exit(1, f"{parser.prog}: error: {error}\n")
    config, _ = parse_train_config(argv, parser)
    # the project's own messages (progress, evidence) at INFO; the libraries' warnings only (their INFO,
    # matplotlib's font substitutions among them, is noise here)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("lib").setLevel(logging.INFO)
    from lib.training import train

    try:
        result = train(config)
    except STOPS as error:  # said in a line of its own; CERNENV_TRACEBACK=1 shows where
        if os.environ.get("CERNENV_TRACEBACK"):
            raise
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    from lib.training.processes import is_main_process

    if is_main_process():  # under `accelerate launch`, one process reports
        payload = json_text(asdict(result), default=str)
        atomic_write(Path(config.output_dir) / "train_result.json", payload + "\n")
        print(payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
