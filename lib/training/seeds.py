"""The three-seed evidence of one configuration at one commit, in one command:

    python -m lib.training.seeds --config configs/train/family.yaml --out build/seeds   # make evidence-seeds

The default configuration, `EVIDENCE_CONFIG`, is the recipe `make reproduce` trains (configs/full.yaml):
its evidence is seed 0 of these three.

1. Each seed (`--seeds`, default 0 1 2) runs `python -m lib.training --config C --seed N` into
   `OUT/seedN/` (its evidence, outputs and `run.log`), `--jobs` at a time (default 2: on a 2-core
   machine two runs of one thread each do more work than one of two).
2. Once the first seed is done, the imitation-only policy given that seed's time for its warm start
   and GRPO together (`imitation_campaigns`: the warm start's campaigns scaled by that time over the
   warm start's) is built and played on the same suite
   (`python -m lib.training.warm_start --evaluate OUT/sft/evidence`).
3. `python -m lib.report.seed_runs` reads them together into `OUT/report/` (each seed's and the pooled
   interval). The committed `evidence/seeds/` is that folder, copied once it has been read.

`OUT/seeds_run.json` records the commit, whether the tree had uncommitted changes (the evidence of a
dirty tree is not the commit's), every command, its exit status and its seconds. Every command
starts and ends on the checkout the driver started on: one that would start after HEAD or the
uncommitted changes moved is not started, and one during which they moved counts as failed (its
evidence could mix two trees); run the seeds from a clone of their own to keep working meanwhile.
Extra flags after `--` go to every training run (`-- --max_steps 2` for a quick look).

Started again with the same `--out` on the same checkout (after a kill, or at a session's end), it
keeps each command that finished there before (exit status 0, the same command, what it leaves
behind still there: `finished_before`) and runs the others: a seed cut short starts again, its warm
start read from `.cache/warm_start/` when that was finished. The report is always made again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from lib.files import write_json

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
EVIDENCE_CONFIG = "configs/train/family.yaml"
"""The evidence recipe: the training configuration `make evidence-seeds` runs three seeds of and
`make reproduce` trains as seed 0 (configs/full.yaml names it too; tests/test_reproduce.py holds the
two equal)."""

Runner = Callable[[List[str], Path], int]
"""Runs a command with its output in a log file; returns its exit status."""


def run_logged(command: List[str], log: Path) -> int:
    """Run `command` in the repository with stdout and stderr in `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        return subprocess.run(command, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT).returncode


def seed_command(config: str, seed: int, out: Path, extra: Sequence[str]) -> List[str]:
    """The training run of `seed` into `out/seed<seed>/`."""
    folder = out / f"seed{seed}"
    return [
        sys.executable,
        "-m",
        "lib.training",
        "--config",
        config,
        "--seed",
        str(seed),
        "--evidence_dir",
        str(folder / "evidence"),
        "--output_dir",
        str(folder / "outputs"),
        *extra,
    ]


def recorded_command(command: Sequence[str]) -> List[str]:
    """`command` as `seeds_run.json` keeps it: the running Python as `python` and paths inside the
    repository relative to it, so the record names no machine's folders."""
    words = ["python" if i == 0 and word == sys.executable else word for i, word in enumerate(command)]
    for i, word in enumerate(words):
        path = Path(word)
        if path.is_absolute() and path.is_relative_to(REPO):
            words[i] = str(path.relative_to(REPO))
    return words


def imitation_campaigns(result: Mapping[str, Any], warm_start_episodes: int) -> int:
    """How many campaigns an imitation-only warm start gets for the time a run (its
    `train_result.json`) spent on its warm start and GRPO together: `warm_start_episodes` scaled by
    that time over the warm start's (the warm start's steps, and so its time, grow with its
    campaigns). A warm start loaded from `.cache/` counts the training time it recorded when it was
    built (`train_seconds`); one cached before that was recorded is refused."""
    seconds = result.get("seconds") or {}
    report = result.get("warm_start") or {}
    warm = (
        float(report.get("train_seconds") or 0.0) if report.get("loaded") else float(seconds.get("warm_start") or 0.0)
    )
    if warm <= 0.0:
        raise ValueError(
            "the run's warm start took no measured time (loaded from a .cache/warm_start/ folder that does "
            "not record it, or none at all): remove that folder and run again"
        )
    grpo = float(seconds.get("grpo") or 0.0)
    return max(warm_start_episodes, math.ceil(warm_start_episodes * (warm + grpo) / warm))


def git_state() -> Dict[str, Any]:
    """The commit the runs are made at, whether tracked files differ from it, and a hash of how
    (`git diff HEAD`: None when they do not)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    changes = git("diff", "HEAD", "--binary")
    return {
        "commit": git("rev-parse", "HEAD") or None,
        "dirty": bool(changes),
        "changes_sha256": hashlib.sha256(changes.encode()).hexdigest() if changes else None,
    }


def checkout_moved(before: Mapping[str, Any], now: Mapping[str, Any]) -> Optional[str]:
    """How the checkout moved from `before` to `now` (two `git_state`s), in words; None if it did not."""
    if before.get("commit") != now.get("commit"):
        return f"HEAD moved from {before.get('commit')} to {now.get('commit')}"
    if before.get("changes_sha256") != now.get("changes_sha256"):
        return "the uncommitted changes to tracked files changed"
    return None


def failure_note(record: Mapping[str, Any], out: Path, name: Optional[str] = None) -> str:
    """Where to look, or what to do, after a failed command (`name`, else any) of a seeds run."""
    moved = [e["moved"] for e in record["commands"] if e.get("moved") and name in (None, e["name"])]
    if moved:
        return (
            f"{moved[0]}. The seeds must come from one checkout: run them again from a clone of their own "
            "(git clone . DIR, DIR a folder outside this checkout) to keep working here meanwhile"
        )
    return f"see {out / name / 'run.log'}" if name else f"see their run.log under {out}"


LEFT_BEHIND = {"seed": Path("outputs") / "train_result.json", "sft": Path("evidence") / "pre_eval.jsonl.gz"}
"""What a finished command leaves in its folder `OUT/NAME/`, by kind of name ("seed0" is a "seed")."""


def finished_before(out: Path, checkout: Mapping[str, Any]) -> Dict[str, Dict[str, Any]]:
    """The commands a previous run of the driver into `out` finished on `checkout` (a `git_state`:
    the same commit, the same uncommitted changes), by name: exit status 0, its checkout unmoved while
    it ran, and what it leaves behind (`LEFT_BEHIND`) still there. Empty without a readable record."""
    try:
        previous = json.loads((out / "seeds_run.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(previous, dict) or checkout_moved(previous, checkout):
        return {}
    finished = {}
    for entry in previous.get("commands") or []:
        name = entry.get("name", "")
        left = LEFT_BEHIND.get("seed" if name.startswith("seed") else name)
        if entry.get("status") == 0 and not entry.get("moved") and left and (out / name / left).is_file():
            finished[name] = entry
    return finished


def run_seeds(
    config: str,
    seeds: Sequence[int],
    out: Path,
    *,
    jobs: int = 2,
    extra: Sequence[str] = (),
    runner: Runner = run_logged,
    state: Callable[[], Dict[str, Any]] = git_state,
) -> Dict[str, Any]:
    """Steps 1-3 of the module's docstring; returns what `OUT/seeds_run.json` holds. Stops (RuntimeError)
    when a command fails, after the others running with it have finished. `state` is the checkout's
    (`git_state`), read at the start and around every command."""
    from lib.training.cli import parse_train_config

    warm_start_episodes = parse_train_config(["--config", config, *extra])[0].warm_start_episodes
    if not warm_start_episodes:
        raise ValueError("the configuration has no warm start (warm_start_episodes 0): nothing to compare GRPO with")
    out.mkdir(parents=True, exist_ok=True)
    started_on = state()
    kept = finished_before(out, started_on)
    record: Dict[str, Any] = {**started_on, "config": config, "seeds": list(seeds), "jobs": jobs, "commands": []}
    lock = threading.Lock()

    def save_record() -> None:
        write_json(out / "seeds_run.json", record, indent=1)

    first = f"seed{seeds[0]}"
    first_failed = threading.Event()  # set by the worker that ran the first seed, before it takes the next job

    def job(name: str, command: List[str]) -> int:
        if first_failed.is_set():
            return -1  # not started: the first seed, which sizes the comparison, failed
        entry: Dict[str, Any] = {"name": name, "command": recorded_command(command)}
        before = kept.get(name)
        if before is not None and before["command"] == entry["command"]:
            with lock:
                record["commands"].append({**before, "kept": True})
            logger.info("%s: kept, finished by the run before on this checkout", name)
            return 0
        moved = checkout_moved(started_on, state())
        if moved:
            entry.update(status=None, moved=f"not started: {moved} since the seeds started")
            status = -2
        else:
            start = time.perf_counter()
            logger.info("%s: %s", name, " ".join(command))
            status = runner(command, out / name / "run.log")
            entry.update(status=status, seconds=round(time.perf_counter() - start, 1))
            moved = checkout_moved(started_on, state())
            if moved:
                entry["moved"] = f"{moved} while it ran: its evidence may mix two trees"
                status = status or -3
        if name == first and status != 0:
            first_failed.set()
        with lock:
            record["commands"].append(entry)
        logger.info("%s: exit status %s%s", name, entry["status"], f" ({entry['moved']})" if moved else "")
        return status

    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            runs = {
                f"seed{seed}": pool.submit(job, f"seed{seed}", seed_command(config, seed, out, extra)) for seed in seeds
            }
            try:
                if runs[first].result() != 0:
                    raise RuntimeError(f"{first} failed: {failure_note(record, out, first)}")
                result = json.loads((out / first / "outputs" / "train_result.json").read_text())
                campaigns = imitation_campaigns(result, warm_start_episodes)
            except (RuntimeError, ValueError, OSError):
                for future in runs.values():  # the seeds not started yet: no hour of work for a run already lost
                    future.cancel()
                raise
            record["imitation_campaigns"] = campaigns
            sft = pool.submit(
                job,
                "sft",
                [
                    sys.executable,
                    "-m",
                    "lib.training.warm_start",
                    "--config",
                    config,
                    "--seed",
                    str(seeds[0]),
                    "--warm_start_episodes",
                    str(campaigns),
                    "--evaluate",
                    str(out / "sft" / "evidence"),
                    *extra,
                ],
            )
            failed = [name for name, future in {**runs, "sft": sft}.items() if future.result() != 0]
    finally:
        save_record()
    if failed:
        raise RuntimeError(f"{', '.join(failed)} failed: {failure_note(record, out)}")
    report = [sys.executable, "-m", "lib.report.seed_runs"]
    for seed in seeds:
        report += ["--run", f"{seed}={out / f'seed{seed}' / 'evidence'}"]
    report += ["--sft", str(out / "sft" / "evidence"), "--out", str(out / "report")]
    if job("report", report) != 0:
        save_record()
        raise RuntimeError(f"lib.report.seed_runs failed: {failure_note(record, out, 'report')}")
    save_record()
    return record


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m lib.training.seeds", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    parser.add_argument("--config", default=EVIDENCE_CONFIG, help="the training configuration")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="the training seeds")
    parser.add_argument("--out", default="build/seeds", help="the folder of every run and the report")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    args = parser.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds names a seed twice: {args.seeds}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        record = run_seeds(args.config, args.seeds, Path(args.out), jobs=args.jobs, extra=extra)
    except (RuntimeError, ValueError) as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    if record["dirty"]:
        print("note: the tree had uncommitted changes: this evidence is not its commit's alone")
    print(f"wrote {args.out}/report (seeds.md) and {args.out}/seeds_run.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
