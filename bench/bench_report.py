"""The report of notebook 04 and the live trajectory browser, measured on evidence of known size.

    python bench/bench_report.py [--tasks 40] [--out build/bench-report]      # make bench-report

1. Evidence: the first `--tasks` held-out tasks played by `RandomAgent` ("before") and
   `HeuristicAgent` ("after") with the published key (whole campaigns, ~20 steps, as a trained
   policy's are; they replay), a short training log, and the rendered evidence.
2. Notebook 04 on it (papermill, headless), exported by `lib.notebooks.export` into three pages: their
   sizes (the target: under 3 MB each).
3. The live browser (`lib.report.browser.TrajectoryBrowser`) in this process: choosing each episode,
   then moving the step slider over every step of it; the slowest and median answer, wall and CPU
   seconds (the target: under 1 s). The machines here are shared and virtual: CPU seconds
   compare across runs, wall seconds only side by side.

Prints one JSON object (and writes it to `--out/bench_report.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_evidence(folder: Path, tasks: int) -> None:
    from lib.agents.baselines import HeuristicAgent, RandomAgent
    from lib.episodes.agent_rollouts import collect_episodes
    from lib.episodes.records import as_episode_dict, save_episodes_jsonl
    from lib.measure.evaluation import PUBLISHED_KEY, heldout_suite
    from lib.report.evidence import EvidencePaths, TrainingLogWriter, render_all

    suite = heldout_suite()
    specs = suite[:: max(1, len(suite) // tasks)][:tasks]  # both parts of the suite
    paths = EvidencePaths(folder)
    paths.ensure()
    for name, agent in (("pre", RandomAgent(seed=0)), ("post", HeuristicAgent())):
        episodes = collect_episodes(
            specs,
            agent=agent,
            make_env=PUBLISHED_KEY.make_env,
            progress=False,
            evaluation_key=PUBLISHED_KEY.record_fields(),
        )
        rows = [json.loads(json.dumps(as_episode_dict(e), default=lambda value: value.item())) for e in episodes]
        save_episodes_jsonl(rows, str(getattr(paths, f"{name}_eval_jsonl")))  # numpy scalars as numbers
    log = TrainingLogWriter(paths.training_log_csv)
    for step in range(1, 6):
        log.append(
            {
                "step": step,
                "loss": 0.1 / step,
                "reward": step * 0.3 - 1.0,
                "reward_std": 0.5,
                "wall_time_s": 60.0 * step,
            }
        )
    render_all(paths)


def measure_pages(evidence: Path, out: Path) -> dict:
    import papermill

    from lib.notebooks.export import export_reports
    from lib.notebooks.reproduce import record_run

    build = out / "build"
    build.mkdir(parents=True, exist_ok=True)
    os.environ["CERNENV_HEADLESS"] = "1"
    start = time.perf_counter()
    papermill.execute_notebook(
        str(ROOT / "notebooks" / "04_evidence_analysis.ipynb"),
        str(build / "04_evidence_analysis.ipynb"),
        parameters={"EVIDENCE_DIR": str(evidence)},
        kernel_name="python3",
        cwd=str(ROOT / "notebooks"),
        progress_bar=False,
    )
    notebook_s = time.perf_counter() - start
    record_run(build, "bench", "04_evidence_analysis", notebook_s)
    pages = export_reports(build, out / "reports")
    return {
        "notebook_04_s": round(notebook_s, 1),
        "executed_notebook_mb": round((build / "04_evidence_analysis.ipynb").stat().st_size / 1e6, 2),
        "pages_mb": {page.name: round(page.stat().st_size / 1e6, 2) for page in pages},
    }


def measure_live_browser(evidence: Path, episodes: int) -> dict:
    from lib.report.browser import TrajectoryBrowser
    from lib.report.evidence import EvidencePaths, read_records

    files = EvidencePaths(evidence)
    pre, post = read_records(files.pre_eval_jsonl).rows, read_records(files.post_eval_jsonl).rows
    start = time.perf_counter()
    browser = TrajectoryBrowser({"pre": pre, "post": post})
    opened = time.perf_counter() - start
    choose, slide = [], []

    def timed(action) -> tuple:
        wall, cpu = time.perf_counter(), time.process_time()
        action()
        return time.perf_counter() - wall, time.process_time() - cpu

    choose.append(timed(lambda: setattr(browser.phase, "value", "post")))  # the scripted physicist's campaigns
    for _, index in list(browser.episode.options)[1 : episodes + 1]:
        choose.append(timed(lambda: setattr(browser.episode, "value", index)))
        for step in range(2, browser.step.max + 1):
            slide.append(timed(lambda: setattr(browser.step, "value", step)))

    def summary(samples: list) -> dict:
        walls, cpus = [w for w, _ in samples], [c for _, c in samples]
        return {
            "n": len(samples),
            "median_wall_s": round(statistics.median(walls), 3),
            "max_wall_s": round(max(walls), 3),
            "median_cpu_s": round(statistics.median(cpus), 3),
            "max_cpu_s": round(max(cpus), 3),
        }

    return {"open_s": round(opened, 2), "choose_episode": summary(choose), "move_slider": summary(slide)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=40, help="held-out tasks in the evidence (each before and after)")
    parser.add_argument("--browse", type=int, default=6, help="episodes the live browser is timed on")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "bench-report")
    args = parser.parse_args(argv)
    os.environ.setdefault("MPLBACKEND", "Agg")
    evidence = args.out / "evidence"
    make_evidence(evidence, args.tasks)
    result = {"tasks": args.tasks, **measure_pages(evidence, args.out)}
    result["live_browser"] = measure_live_browser(evidence, args.browse)
    text = json.dumps(result, indent=1)
    (args.out / "bench_report.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
