"""`python -m lib.training [--config FILE.yaml] [--FIELD VALUE ...]`: one GRPO run.

With no arguments it runs the default CPU training (`TrainConfig()`). Every `TrainConfig`
field is a typed flag (`--max_steps 10`, `--help` lists them with their meaning); a config
file (YAML or JSON) holds field names, and flags override it (`lib.training.cli`). The
result (timings, before/after metrics) is printed as JSON and written to
`<output_dir>/train_result.json`.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import asdict
from pathlib import Path

from lib.files import atomic_write, json_text
from lib.training.cli import parse_train_config, train_config_parser


def main(argv=None) -> int:
    config, _ = parse_train_config(argv, train_config_parser(description=__doc__, argv=argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from lib.training import train

    result = train(config)
    from lib.training.processes import is_main_process

    if is_main_process():  # under `accelerate launch`, one process reports
        payload = json_text(asdict(result), default=str)
        atomic_write(Path(config.output_dir) / "train_result.json", payload + "\n")
        print(payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
