"""Replay a recorded episode in the environment to see its physics step by step.

An evidence file (`pre_eval.jsonl.gz`, `post_eval.jsonl.gz`) keeps what the agent saw and sent,
not the spectra and fits its actions made. The environment is deterministic per seed,
so sending the recorded actions again rebuilds them; `replay` checks that it does, step by
step, by comparing the rewards (a changed environment or a record from another code version
fails loudly instead of showing someone else's physics). `check_replay` compares everything
a record holds from the environment (`python -m lib.report.replay FILE...`, `make verify-evidence`).

The environment computes the same bits on every x86-64 processor (`cernenv.physics.portable`), and
its fits give the same answers under either of the C library's `exp` and `log`
(`cernenv.physics.fitting`), so a record made on any machine replays exactly, prompts included:
tests/test_evidence_replay.py replays the committed evidence in a process that computes as a
processor without AVX or FMA would (`BASELINE_PROCESSOR_ENVIRONMENT`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional

from cernenv import CERNCollisionEnvironment
from cernenv.scenarios import list_scenarios
from lib.episodes.records import as_episode_dict, load_episodes_jsonl
from lib.files import json_text
from lib.report.plotting import analysis_snapshot

BASELINE_PROCESSOR_ENVIRONMENT = {
    "NPY_DISABLE_CPU_FEATURES": (
        "X86_V3 X86_V4 AVX512_ICL AVX512_SPR AVX2 FMA3 F16C AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL"
    ),
    "NUMBA_CPU_NAME": "generic",
    "OPENBLAS_CORETYPE": "Nehalem",
    "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2,-FMA",
}
"""Environment variables under which a new Python process computes as an x86-64 processor without
AVX or FMA would: numpy's kernels for its baseline (SSE4.2) only, numba's code for a generic x86-64,
OpenBLAS's kernels for Nehalem, and the C library's `exp`, `log` and `pow` for a processor without
FMA (glibc's other implementations, which differ from those for FMA in rare last bits).
`bench/bench_libm.py` (`make bench-libm`) plays thousands of new episodes under both."""

REWARD_TOLERANCE = 1e-6
"""Largest difference between a recorded and a replayed step reward that counts as equal."""


class ReplayMismatch(RuntimeError):
    """The replayed episode earned other rewards than the recorded one."""


def environment_for(episode: Mapping[str, Any]) -> CERNCollisionEnvironment:
    """An environment that draws `episode`'s world: with the evaluation key it was played with
    (`lib.measure.evaluation.key_of_record`), if any."""
    from lib.measure.evaluation import key_of_record

    key = key_of_record(episode)
    return key.make_env() if key is not None else CERNCollisionEnvironment()


def reset_for(env: CERNCollisionEnvironment, episode: Mapping[str, Any]) -> Any:
    """Reset `env` to the world `episode` was played in (its seed and scenario or difficulty)."""
    seed, scenario = episode.get("seed"), episode.get("scenario")
    if seed is None:
        raise ValueError("the episode has no seed: it cannot be replayed")
    if scenario in list_scenarios():
        return env.reset(seed=int(seed), scenario=scenario)
    return env.reset(seed=int(seed), difficulty=episode.get("difficulty"))


def replay(episode: Any, *, upto_step: Optional[int] = None) -> List[Dict[str, Any]]:
    """The analysis objects (`lib.report.plotting.analysis_snapshot`) after each recorded step.

    Returns one snapshot per step played (all of them, or the first `upto_step`); each
    holds `spectrum`, `resonance_fit`, `background_fit` and `scan` as they stood after
    that step (None until made), and the observation's `logbook` (the latest result of each
    analysis verb, as the agent was told it). Raises `ReplayMismatch` where a reward differs
    from the record's.
    """
    record = as_episode_dict(episode)
    steps = list(record.get("steps") or [])[:upto_step]
    env = environment_for(record)
    reset_for(env, record)
    snapshots = []
    for index, step in enumerate(steps):
        obs = env.step(step.get("action"))
        recorded = float(step.get("reward", math.nan))
        if not math.isclose(float(obs.reward or 0.0), recorded, abs_tol=REWARD_TOLERANCE):
            raise ReplayMismatch(
                f"seed {record.get('seed')} step {index}: replayed reward {obs.reward!r} ≠ recorded {recorded!r}; "
                "the record comes from another version of the environment: regenerate the evidence "
                "(make train or make reproduce)"
            )
        snapshots.append({**analysis_snapshot(env), "logbook": obs.logbook})
    return snapshots


@dataclass
class ReplayCheck:
    """What a replay of a recorded episode found (`check_replay`): `outcome` lists the steps
    whose reward, reward breakdown, rule violations, observation summary or end differ, and an
    episode grade, reward components or resources that differ; `prompts`, the steps whose
    observation, rendered for the policy, is not the prompt the agent saw."""

    steps: int
    outcome: List[str] = field(default_factory=list)
    prompts: List[str] = field(default_factory=list)


PROMPT_STYLES = (
    {},
    {"compact_followups": True},
    {"style": "brief"},
)
"""The observation styles a recorded prompt may be written in (`LLMAgentConfig` fields): the
default, its compacted conversation, and the brief style real tokenizers play."""


def prompt_renderings(obs: Any, earlier: List[str]) -> Iterator[str]:
    """Every message a policy could have been shown for `obs` in any of `PROMPT_STYLES`, the default
    style's first: the first message of a conversation or a single decision (which states the task),
    and a later message of a conversation whose earlier user messages were `earlier` (which leaves the
    task out, and in the compact and brief styles the lines that repeat them)."""
    from lib.agents.prompting import LLMAgentConfig, build_chat
    from lib.episodes.chat import followup_message

    history = [{"role": "user", "content": text} for text in earlier]
    for fields in PROMPT_STYLES:
        config = LLMAgentConfig(**fields)
        yield build_chat(obs, config)[-1]["content"]
        yield followup_message(obs, config, history)["content"]


def check_replay(episode: Any) -> ReplayCheck:
    """Replay `episode` (its recorded actions from its seed) and compare everything the record
    holds from the environment with what the environment returns now (`ReplayCheck`). Unlike
    `replay`, which stops at the first reward that differs, this lists every difference: the
    check that committed evidence still describes the environment of a checkout
    (`python -m lib.report.replay FILE...`, `make verify-evidence`)."""
    from lib.episodes.agent_rollouts import episode_record, step_record

    record = as_episode_dict(episode)
    env = environment_for(record)
    obs = reset_for(env, record)
    where = f"seed {record.get('seed')} ({record.get('scenario')})"
    check = ReplayCheck(steps=len(record.get("steps") or []))
    steps = []
    for index, recorded in enumerate(record.get("steps") or []):
        if obs.done:
            check.outcome.append(f"{where}: the replay ended after {index} steps, the record has more")
            break
        earlier = [step.get("prompt", "") for step in (record.get("steps") or [])[:index]]
        if recorded.get("prompt") and recorded["prompt"] not in prompt_renderings(obs, earlier):  # stops at a match
            check.prompts.append(f"{where} step {index}")
        next_obs = env.step(recorded.get("action"))
        replayed = step_record(
            obs,
            recorded.get("action"),
            next_obs,
            prompt=recorded.get("prompt", ""),
            completion=recorded.get("completion", ""),
            parsed_ok=recorded.get("parsed_ok", True),
            parse_error=recorded.get("parse_error"),
        )
        steps.append(replayed)
        fresh = json.loads(json_text(as_episode_dict(replayed)))  # as a JSONL line holds it
        changed = sorted(key for key in fresh if fresh[key] != recorded.get(key))
        if changed:
            check.outcome.append(f"{where} step {index}: {', '.join(changed)}")
        obs = next_obs
    fresh = as_episode_dict(
        episode_record(
            env,
            seed=int(record["seed"]),
            steps=steps,
            last_obs=obs,
            agent_name=record.get("agent", ""),
            evaluation_key=record.get("evaluation_key"),
        )
    )
    fresh = json.loads(json_text({k: v for k, v in fresh.items() if k != "steps"}))
    changed = sorted(key for key in fresh if fresh[key] != record.get(key))
    if changed:
        check.outcome.append(f"{where}: {', '.join(changed)}")
    return check


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m lib.report.replay FILE...`: replay every episode of evidence JSONL files and report
    what differs; exit 1 where an outcome differs (or, with --strict, a prompt)."""
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m lib.report.replay", description=main.__doc__)
    parser.add_argument(
        "files", nargs="+", type=Path, help="episode JSONL files, plain or .gz (evidence/pre_eval.jsonl.gz, ...)"
    )
    parser.add_argument("--strict", action="store_true", help="also fail where a prompt differs")
    args = parser.parse_args(argv)
    failed = False
    for path in args.files:
        if not path.is_file():
            parser.error(f"{path} is not a file")
        checks = [check_replay(episode) for episode in load_episodes_jsonl(str(path))]
        steps = sum(c.steps for c in checks)
        outcome = [line for c in checks for line in c.outcome]
        prompts = [line for c in checks for line in c.prompts]
        print(
            f"{path}: {len(checks)} episodes, {steps} steps replayed; outcomes differ at {len(outcome)}, "
            f"prompts at {len(prompts)} ({len(prompts) / max(steps, 1):.1%} of steps)"
        )
        for line in outcome[:20] + (prompts[:5] if args.strict else []):
            print("  " + line)
        failed |= bool(outcome) or (args.strict and bool(prompts))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
