"""`python -m lib.training [--config FILE.json|.yaml] [--set field=value ...]`: one GRPO run.

With no arguments it runs the default CPU training (`TrainConfig()`). `--set` takes
`TrainConfig` field names; values are read as JSON when they parse (numbers, true,
null, lists), else as strings. The result (timings, before/after metrics) is printed
as JSON and written to `<output_dir>/train_result.json`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from lib.training.config import TrainConfig


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_config(argv=None) -> TrainConfig:
    parser = argparse.ArgumentParser(prog="python -m lib.training", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a JSON or YAML file of TrainConfig fields")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override one TrainConfig field (repeatable)")
    args = parser.parse_args(argv)
    values = {}
    if args.config:
        text = Path(args.config).read_text()
        if args.config.endswith((".yaml", ".yml")):
            import yaml

            values = yaml.safe_load(text) or {}
        else:
            values = json.loads(text)
    for item in args.set:
        name, sep, raw = item.partition("=")
        if not sep:
            parser.error(f"--set takes FIELD=VALUE, got {item!r}")
        values[name.strip()] = _value(raw)
    try:
        return TrainConfig.from_dict(values)
    except (TypeError, ValueError) as error:
        parser.error(str(error))


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = parse_config(argv)
    from lib.training.run import train

    result = train(config)
    payload = json.dumps(asdict(result), indent=2, default=str)
    out = Path(config.output_dir) / "train_result.json"
    out.write_text(payload + "\n")
    print(payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
