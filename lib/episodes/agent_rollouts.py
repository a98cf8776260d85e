"""Playing episodes and recording them step by step: prompt, completion, action, reward.

`collect_episode` runs an LLM (a `generate_fn`) in process against
`CERNCollisionEnvironment`; `collect_agent_episode` runs any agent with the
`reset()`/`act(obs)` protocol (the baselines). Both return the same `EpisodeRecord`,
which `lib.episodes.records.save_episodes_jsonl` / `load_episodes_jsonl` store one episode per line.

A completion that is not a valid action is recorded (`parsed_ok=False`, `parse_error`)
and sent to the environment as it is: the environment refuses it and charges the
violation penalty. Nothing substitutes a good move for it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from cernenv import CERNCollisionEnvironment, CollisionObservation, ExperimentAction
from cernenv.rules import RuleViolation
from cernenv.rules import parse_action as validate_action
from lib.agents.prompting import LLMAgent, LLMAgentConfig
from lib.episodes.records import EpisodeRecord, StepRecord, spec_fields
from lib.progress import Progress

PromptFn = Callable[[List[Dict[str, str]]], str]
"""Formats a chat into the model's prompt, e.g. a tokenizer's `apply_chat_template(..., tokenize=False,
add_generation_prompt=True)`."""
TextGenerateFn = Callable[[str, LLMAgentConfig], str]
"""Runs the model on a prompt text with the config's sampling settings; returns the raw completion
text (the seed collector's `generate_fn`, one decision at a time; multi-turn play in token space
takes `lib.episodes.generation.GenerateFn`)."""


def _summarise(obs: CollisionObservation) -> Dict[str, Any]:
    return {
        "step_index": obs.step_index,
        "selected_channel": obs.selected_channel,
        "selected_beam_energy_tev": obs.selected_beam_energy_tev,
        "n_candidates": len(obs.candidate_masses_gev),
        "best_significance": obs.cumulative_significance,
        "budget_remaining_musd": obs.resource_usage.budget_remaining_musd,
        "luminosity_remaining_fb": obs.resource_usage.luminosity_remaining_fb,
    }


def _as_json(payload: Any) -> Any:
    return payload.model_dump(mode="json") if isinstance(payload, ExperimentAction) else payload


def _parse_status(agent: Any, payload: Any, obs: CollisionObservation) -> Tuple[bool, Optional[str]]:
    """(parsed_ok, parse_error): the LLM agent's own parse, else whether the payload validates
    (its references resolved against `obs`, the observation it answered)."""
    parse = getattr(agent, "last_parse", None)
    if parse is not None:
        return parse.ok, parse.error
    try:
        validate_action(payload, obs.references)
    except RuleViolation as violation:
        return False, str(violation)
    return True, None


def _reset_agent(agent: Any, env: CERNCollisionEnvironment, reveal_truth: bool) -> None:
    """`reset()`; then, only where the caller says `reveal_truth` (the evaluator, never the
    agent), `observe_truth(hidden truth)`: how the oracle baseline reads the answer."""
    agent.reset()
    if reveal_truth:
        observe = getattr(agent, "observe_truth", None)
        if observe is None:
            raise TypeError(f"reveal_truth is for agents with observe_truth(truth), such as OracleAgent: {agent!r}")
        observe(env.hidden_truth())


def transitions(
    env: CERNCollisionEnvironment,
    agent: Any,
    *,
    seed: int,
    scenario: Optional[str] = None,
    difficulty: Optional[str] = None,
    max_steps: Optional[int] = None,
    reveal_truth: bool = False,
) -> Iterator[Tuple[CollisionObservation, Any, CollisionObservation]]:
    """Play one episode, yielding (observation, what the agent sent, next observation).
    `reveal_truth`: hand the agent the hidden truth (`observe_truth`), for the oracle alone."""
    if max_steps is not None and max_steps < 1:
        raise ValueError(f"max_steps must be at least 1 (or None for the environment's), got {max_steps}")
    obs = env.reset(seed=seed, scenario=scenario, difficulty=difficulty)
    _reset_agent(agent, env, reveal_truth)
    for _ in range(max_steps or env.max_steps):
        if obs.done:
            return
        payload = agent.act(obs)
        next_obs = env.step(payload)
        yield obs, payload, next_obs
        obs = next_obs


def step_record(
    obs: CollisionObservation,
    payload: Any,
    next_obs: CollisionObservation,
    *,
    prompt: str = "",
    completion: str = "",
    parsed_ok: bool,
    parse_error: Optional[str],
) -> StepRecord:
    """The record of one step: `obs` seen, `payload` sent, `next_obs` returned."""
    return StepRecord(
        step=obs.step_index,
        prompt=prompt,
        completion=completion,
        action=_as_json(payload),
        parsed_ok=parsed_ok,
        reward=float(next_obs.reward or 0.0),
        done=next_obs.done,
        rule_violations=list(next_obs.rule_violations),
        observation_summary=_summarise(obs),
        parse_error=parse_error,
        reward_breakdown=dict(next_obs.reward_breakdown),
    )


def episode_record(
    env: CERNCollisionEnvironment,
    *,
    seed: int,
    steps: List[StepRecord],
    last_obs: CollisionObservation,
    agent_name: str,
    evaluation_key: Optional[Dict[str, str]] = None,
) -> EpisodeRecord:
    """The record of the episode `env` has just played (its state, grade and hidden truth, read
    now); `evaluation_key`: what `EvaluationKey.record_fields` says of the key its world used."""
    state = env.state
    grade = env.episode_grade() or {}
    return EpisodeRecord(
        seed=seed,
        scenario=state.scenario_name,
        difficulty=state.difficulty,
        truth=env.hidden_truth(),
        total_reward=sum(step.reward for step in steps),
        cumulative_reward=float(state.cumulative_reward),
        terminal_reward=grade.get("terminal_reward"),
        discovered=grade.get("discovered"),
        correct_mass=grade.get("correct_mass"),
        correct_channel=grade.get("correct_channel"),
        correct_spin=grade.get("correct_spin"),
        steps=steps,
        agent=agent_name,
        correct_outcome=grade.get("correct_outcome"),
        reward_components=dict(state.reward_components),
        resources=last_obs.resource_usage.model_dump(),
        n_steps=len(steps),
        evaluation_key=evaluation_key,
    )


def collect_agent_episode(
    *,
    env: CERNCollisionEnvironment,
    agent: Any,
    seed: int,
    scenario: Optional[str] = None,
    difficulty: Optional[str] = None,
    max_steps: Optional[int] = None,
    agent_name: Optional[str] = None,
    reveal_truth: bool = False,
    evaluation_key: Optional[Dict[str, str]] = None,
) -> EpisodeRecord:
    """Play and record one episode of `agent` (prompt and completion are the LLM agent's, else "").
    `reveal_truth` hands it the hidden truth (the oracle's mechanism, `transitions`)."""
    steps: List[StepRecord] = []
    last_obs = None
    for obs, payload, next_obs in transitions(
        env, agent, seed=seed, scenario=scenario, difficulty=difficulty, max_steps=max_steps, reveal_truth=reveal_truth
    ):
        parsed_ok, parse_error = _parse_status(agent, payload, obs)
        steps.append(
            step_record(
                obs,
                payload,
                next_obs,
                prompt=getattr(agent, "last_prompt", ""),
                completion=getattr(agent, "last_completion", ""),
                parsed_ok=parsed_ok,
                parse_error=parse_error,
            )
        )
        last_obs = next_obs
    return episode_record(
        env,
        seed=seed,
        steps=steps,
        last_obs=last_obs,
        agent_name=agent_name or type(agent).__name__,
        evaluation_key=evaluation_key,
    )


def collect_episode(
    *,
    env: CERNCollisionEnvironment,
    seed: int,
    scenario: Optional[str],
    difficulty: Optional[str],
    prompt_fn: PromptFn,
    generate_fn: TextGenerateFn,
    config: LLMAgentConfig = LLMAgentConfig(),
    max_steps: Optional[int] = None,
) -> EpisodeRecord:
    """Play and record one episode of the LLM behind `generate_fn(prompt, config)`."""
    agent = LLMAgent(lambda prompt: generate_fn(prompt, config), prompt_fn, config)
    return collect_agent_episode(
        env=env, agent=agent, seed=seed, scenario=scenario, difficulty=difficulty, max_steps=max_steps
    )


def collect_episodes(
    specs: Iterable[Any],
    *,
    env: Optional[CERNCollisionEnvironment] = None,
    make_env: Optional[Callable[[], CERNCollisionEnvironment]] = None,
    agent: Any = None,
    prompt_fn: Optional[PromptFn] = None,
    generate_fn: Optional[TextGenerateFn] = None,
    config: LLMAgentConfig = LLMAgentConfig(),
    max_steps: Optional[int] = None,
    progress: bool = True,
    desc: str = "episodes",
    reveal_truth: bool = False,
    evaluation_key: Optional[Dict[str, str]] = None,
) -> List[EpisodeRecord]:
    """Record one episode per spec (`lib.episodes.records.EpisodeSpec`, a mapping or a tuple), with
    either `agent` or an LLM (`prompt_fn` and `generate_fn`), in one environment (`env`, or
    one made by `make_env`, else a new `CERNCollisionEnvironment`). `reveal_truth` and
    `evaluation_key`: as `collect_agent_episode` takes them."""
    if (agent is None) == (generate_fn is None):
        raise ValueError("collect_episodes needs either agent=... or prompt_fn=... and generate_fn=..., not both")
    if generate_fn is not None:
        if prompt_fn is None:
            raise ValueError("an LLM needs prompt_fn (e.g. a tokenizer's apply_chat_template) with generate_fn")
        agent = LLMAgent(lambda prompt: generate_fn(prompt, config), prompt_fn, config)
    env = env or (make_env() if make_env is not None else CERNCollisionEnvironment())
    specs = [spec_fields(item) for item in specs]
    counter = Progress(desc or "episodes", len(specs), unit="episode") if progress else None
    episodes = []
    for spec in specs:
        episodes.append(
            collect_agent_episode(
                env=env,
                agent=agent,
                max_steps=max_steps,
                reveal_truth=reveal_truth,
                evaluation_key=evaluation_key,
                **spec,
            )
        )
        if counter is not None:
            counter.update(len(episodes))
    return episodes
