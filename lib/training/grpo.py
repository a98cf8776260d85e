"""Multi-turn GRPO on CERNenv with TRL's `GRPOTrainer`.

What one optimisation step does:

1. The trainer draws training tasks (a seed with a curated scenario or a difficulty)
   from the dataset and repeats each `num_generations` times: a *group*.
2. `CampaignRollout` (the trainer's `rollout_func`) plays every episode of the batch to
   the end with the current policy (`lib.episodes.llm_rollouts.play_episodes`): the model writes each
   action and reads the environment's observation after it. A group plays the same
   seed and scenario, so its episodes differ only by what the policy sampled. In the
   `conversation` context an episode is one sample (the whole campaign, environment text
   masked by `env_mask`); in the `turn` context each decision is its own sample (the chat it
   read and its reply), the dataset holding each task once per decision slot
   (`TrainConfig.turn_samples`), so GRPO's sample count per step stays fixed however long
   the episodes are. With `dynamic_sampling` (DAPO), a group whose returns all but agree is
   played again on a fresh task of the same kind before the step trains (`replacement_task`).
3. Each reward component (`cernenv.rewards.COMPONENT_NAMES`) is its own reward function;
   their sum is the episode's return. TRL logs each as `rewards/<component>/mean`.
4. GRPO's advantage is the return minus its group's mean, scaled as `scale_rewards`
   says (by default by the standard deviation over the step's episodes); every action token
   of the episode gets it (in the `turn` context: of the decision slot's group, which holds
   the same episodes), environment tokens are masked (`env_mask`), and the clipped
   policy-gradient loss is minimised. With `credit: decision` (`turn` context) each decision
   gets its own advantage instead (`lib.training.credit`: the episode's, GiGPO's step
   advantage where episodes of the group read the same observation, its own penalty), which
   the rollout returns per sample and `decision_credit_trainer` hands to TRL.

The dataset's `prompt` column holds the task as JSON, not text for the model: the
environment writes the model's actual prompt (its first observation) at reset.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import numpy as np

from cernenv.rewards import COMPONENT_NAMES
from lib.agents.prompting import Sampling
from lib.episodes.generation import GenerateFn, hf_generate_fn
from lib.episodes.llm_rollouts import PlayedEpisode, play_episodes
from lib.episodes.records import EpisodeRecord, EpisodeSpec
from lib.measure.evaluation import assert_disjoint_from_suite, heldout_suite, validation_suite
from lib.report.evidence import RewardComponentLogWriter
from lib.seeds import replacement_seed_offset, rollout_sampling_seed
from lib.training.config import VALIDATION_EPISODES, TrainConfig
from lib.training.credit import ADVANTAGE_FIELD, credit_settings, decision_credit, episode_decisions
from lib.training.policy_evaluation import adapter_merged
from lib.training.processes import gather, process_index
from lib.training.trainer_class import admitted_tokens_of

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- tasks


def training_tasks(config: TrainConfig, n_groups: int) -> List[Dict[str, Any]]:
    """`n_groups` training tasks on seeds from `config.train_seed_start` (disjoint from the
    held-out suite): a `curated_fraction` share of curated scenarios in turn, the rest
    procedural with difficulties in turn. With `config.curriculum` the procedural tasks go
    easy → hard over the run and the curated ones are spread evenly through it; without,
    the order is shuffled."""
    n_curated = int(round(n_groups * config.curated_fraction))
    n_procedural = n_groups - n_curated
    curated = [{"scenario": config.scenarios[i % len(config.scenarios)], "difficulty": None} for i in range(n_curated)]
    procedural = [
        {"scenario": None, "difficulty": config.difficulties[i % len(config.difficulties)]} for i in range(n_procedural)
    ]
    if config.curriculum:
        procedural.sort(key=lambda task: config.difficulties.index(task["difficulty"]))
        keyed = [((k + 0.5) / n_curated, task) for k, task in enumerate(curated)]
        keyed += [((k + 0.5) / n_procedural, task) for k, task in enumerate(procedural)]
        tasks = [task for _, task in sorted(keyed, key=lambda pair: pair[0])]
    else:
        tasks = curated + procedural
        np.random.default_rng(config.seed).shuffle(tasks)
    tasks = [{"seed": config.train_seed_start + i, **task} for i, task in enumerate(tasks)]
    assert_disjoint_from_suite(task["seed"] for task in tasks)
    return tasks


def training_dataset(config: TrainConfig):
    """The trainer's dataset: one row per group, `prompt` = the task as JSON; in the `turn`
    context one row per group and decision slot (`turn_slot`, 0 .. `turn_samples` - 1)."""
    from datasets import Dataset

    groups_per_step = config.episodes_per_step // config.num_generations
    tasks = training_tasks(config, config.max_steps * groups_per_step)
    if config.policy_context == "turn":
        tasks = [{**task, "turn_slot": slot} for task in tasks for slot in range(config.turn_samples)]
    return Dataset.from_list([{"prompt": json.dumps(task, sort_keys=True)} for task in tasks])


def slot_turn(n_turns: int, slot: int, n_slots: int, rng: np.random.Generator) -> Optional[int]:
    """Which of an episode's `n_turns` decisions decision slot `slot` of `n_slots` trains: the
    slot's own when there are no more decisions than slots (None past the last one), else one
    drawn uniformly from the slot's stretch, the `slot`-th of `n_slots` equal stretches."""
    if n_turns <= n_slots:
        return slot if slot < n_turns else None
    low, high = (slot * n_turns) // n_slots, ((slot + 1) * n_turns) // n_slots
    return int(rng.integers(low, high))


def checkpoint_suite(config: TrainConfig) -> List[EpisodeSpec]:
    """The fixed subset of the held-out suite evaluated at checkpoints: one episode of each curated
    scenario, the rest spread evenly over the unseen part (every difficulty), so it covers both
    parts; a subset smaller than the curated scenarios is spread over the whole suite. With
    `eval_split: validation`, the first `checkpoint_eval_episodes` campaigns of the validation split."""
    if config.eval_split == "validation":
        return list(validation_suite(config.checkpoint_eval_episodes))
    suite = heldout_suite()
    n = min(config.checkpoint_eval_episodes, len(suite))
    known = list({spec.scenario: spec for spec in reversed(suite) if spec.part == "known_physics"}.values())[::-1]
    if n < len(known):
        index = np.linspace(0, len(suite) - 1, n).round().astype(int)
        return [suite[i] for i in sorted(set(index.tolist()))]
    unseen = [spec for spec in suite if spec.part == "unseen"]
    index = np.linspace(0, len(unseen) - 1, n - len(known)).round().astype(int)
    return known + [unseen[i] for i in sorted(set(index.tolist()))]


def evaluation_suite(config: TrainConfig) -> List[EpisodeSpec]:
    """The held-out suite for the pre/post evaluation (all of it unless `eval_episodes`); with
    `eval_split: validation`, the validation split's first `eval_episodes` (`VALIDATION_EPISODES`)."""
    if config.eval_split == "validation":
        return list(validation_suite(config.eval_episodes or VALIDATION_EPISODES))
    suite = list(heldout_suite())
    if config.eval_episodes is None or config.eval_episodes >= len(suite):
        return suite
    index = np.linspace(0, len(suite) - 1, config.eval_episodes).round().astype(int)
    return [suite[i] for i in sorted(set(index.tolist()))]


# ----------------------------------------------------------------------------- rewards


def _component_reward(name: str) -> Callable[..., List[float]]:
    def reward(completions: Sequence[Any], reward_components: Sequence[Dict[str, float]], **_: Any) -> List[float]:
        return [float(components.get(name, 0.0)) for components in reward_components]

    reward.__name__ = name  # TRL logs rewards/<__name__>/mean
    reward.__doc__ = f"The episode's `{name}` reward component (see cernenv.rewards.REWARD_COMPONENTS)."
    return reward


REWARD_FUNCS = [_component_reward(name) for name in COMPONENT_NAMES]
"""One reward function per reward component, all weight 1: their sum is the episode return."""


# ----------------------------------------------------------------------------- rollouts


def rollout_row(step: int, records: Sequence[EpisodeRecord]) -> Dict[str, Any]:
    """A reward_components.csv row (`RewardComponentLogWriter`) for one step's episodes: each rate
    with the count it is over (`*_n`), each mean with its 95% bootstrap interval (`*_low`, `*_high`)."""
    from lib.measure.comparison import bootstrap_interval

    steps = [s for r in records for s in r.steps]
    terminal = [r.terminal_reward or 0.0 for r in records]
    cumulative = [r.total_reward for r in records]
    exists = [r for r in records if (r.truth or {}).get("exists")]
    row: Dict[str, Any] = {"step": step, "n": len(records)}
    means = {
        "mean_cumulative": cumulative,
        "mean_terminal": terminal,
        "mean_step_shaping": np.subtract(cumulative, terminal).tolist(),
    }
    for name, values in means.items():
        row[name] = float(np.mean(values))
        row[f"{name}_low"], row[f"{name}_high"] = bootstrap_interval(values) or (None, None)
    rates = {
        "discovered_rate": [r.discovered for r in records],
        "mass_correct_rate": [r.correct_mass for r in exists],
        "channel_correct_rate": [r.correct_channel for r in exists],
        "spin_correct_rate": [r.correct_spin for r in exists],
        "parsed_rate": [s.parsed_ok for s in steps],
    }
    for name, values in rates.items():
        graded = [bool(v) for v in values if v is not None]
        row[name] = float(np.mean(graded)) if graded else None
        row[f"{name}_n"] = len(graded)
    row["mean_n_steps"] = float(np.mean([r.n_steps for r in records]))
    return row


class CampaignRollout:
    """GRPOTrainer's `rollout_func`: plays each task of the batch as a whole episode.

    Returns the trainer's required `prompt_ids`, `completion_ids` and `logprobs`, the
    `env_mask` that keeps environment text out of the loss, and `reward_components` (one
    dict per episode), which TRL forwards to the reward functions.
    """

    def __init__(
        self,
        config: TrainConfig,
        tokenizer: Any,
        *,
        evidence_dir: Optional[Path] = None,
        generate_fn_factory: Optional[Callable[[Any], GenerateFn]] = None,
        backend: str = "trl",
    ) -> None:
        self.config = config
        self.backend = backend
        self.tokenizer = tokenizer
        self.sampling = config.sampling
        self.writer = RewardComponentLogWriter(Path(evidence_dir) / "reward_components.csv") if evidence_dir else None
        self.generate_fn_factory = generate_fn_factory
        self.calls = 0
        self.sampling_stats: List[Dict[str, int]] = []
        """Per call with dynamic sampling: groups, those alike before and after, groups played again."""
        self.last_episodes: List[PlayedEpisode] = []
        self.timings: List[Dict[str, float]] = []
        """Per call: seconds in generation, in the environment, and tokens generated."""

    def _generate_fn(self, trainer: Any) -> GenerateFn:
        if self.generate_fn_factory is not None:
            return self.generate_fn_factory(trainer)
        if getattr(trainer, "use_vllm", False):
            return vllm_generate_fn(trainer)
        model = trainer.accelerator.unwrap_model(trainer.model)
        return hf_generate_fn(model, self.tokenizer, self.config.generation_engine, unsloth=self.backend == "unsloth")

    def _playing(self, trainer: Any) -> Any:
        """The block the step's episodes are played in: the policy's adapter merged, on a CPU
        (`adapter_merged`), when it plays through transformers."""
        if self.generate_fn_factory is not None or getattr(trainer, "use_vllm", False):
            return contextlib.nullcontext()
        return adapter_merged(trainer.accelerator.unwrap_model(trainer.model))

    def __call__(self, prompts: List[Any], trainer: Any) -> Dict[str, Any]:
        """Play `prompts`, this process's contiguous share of the step's samples (all of them
        with one process)."""
        rows = [json.loads(p) if isinstance(p, str) else dict(p) for p in prompts]
        slots = [row.pop("turn_slot", None) for row in rows]
        if self.config.policy_context == "turn":
            # sample i is decision slot slots[i] of episode (task, i's place in its group): each
            # such episode is played once and serves all its slots
            first_sample = process_index() * len(rows)
            keys = [
                (json.dumps(row, sort_keys=True), (first_sample + i) % self.config.num_generations)
                for i, row in enumerate(rows)
            ]
            episode_of = {key: index for index, key in enumerate(dict.fromkeys(keys))}
            tasks = [json.loads(task) for task, _ in episode_of]
        else:
            tasks = rows
        timed = _TimedGenerate(self._generate_fn(trainer))
        start = time.perf_counter()
        # The sampling seed follows the trainer's step, not a call counter: a run resumed from a
        # checkpoint samples the same episodes as the run that was not interrupted. Each lockstep
        # batch is seeded by its first episode's index in the step (play_episodes adds the index
        # within the share, `first` the share's offset), so N processes sample what one process
        # sampling in batches of `rollout_batch_size` = the share does.
        completed_steps = int(getattr(getattr(trainer, "state", None), "global_step", self.calls))
        first = process_index() * len(tasks)
        with self._playing(trainer):
            episodes = self._play(timed, tasks, rollout_sampling_seed(self.config.seed, completed_steps, first))
            if self.config.dynamic_sampling:
                tasks, episodes = self._resample_alike_groups(timed, tasks, episodes, completed_steps, first)
        total = time.perf_counter() - start
        self.calls += 1
        self.last_episodes = episodes
        self.timings.append(
            {
                "generation_s": timed.seconds,
                "environment_s": total - timed.seconds,
                "generated_tokens": float(timed.tokens),
            }
        )
        # the optimisation step these episodes train (training_log.csv counts steps from 1 too)
        step = int(getattr(getattr(trainer, "state", None), "global_step", 0)) + 1
        records = gather([episode.record for episode in episodes])  # the whole step's, on every process
        if self.writer is not None:
            self.writer.append(rollout_row(step, records))
        if self.config.policy_context == "turn":
            rng = np.random.default_rng(rollout_sampling_seed(self.config.seed, completed_steps, first))
            played = [episodes[episode_of[key]] for key in keys]
            advantages = None
            if self.config.credit == "decision":
                local = [  # grouped by the task each episode played (dynamic sampling may have replaced it)
                    decision
                    for key, index in episode_of.items()
                    for decision in episode_decisions(
                        json.dumps(tasks[index], sort_keys=True),
                        _episode_name(key),
                        episodes[index].turns,
                        episodes[index].record.steps,
                    )
                ]
                credit = decision_credit(gather(local), **credit_settings(self.config))  # the whole step's
                summary = credit.summary()
                logger.info(
                    "decision credit, step %d: %d decisions, %.0f%% in an anchor state, %.0f%% penalised; "
                    "mean |term| episode %.3f, step %.3f, penalty %.3f",
                    step,
                    summary["decisions"],
                    100 * summary["anchored"],
                    100 * summary["penalised"],
                    summary["mean_abs_episode_term"],
                    summary["mean_abs_step_term"],
                    summary["mean_abs_penalty_term"],
                )
                by_episode: Dict[str, Dict[int, float]] = {}
                for (name, turn), value in credit.advantage.items():
                    by_episode.setdefault(name, {})[turn] = value
                advantages = [by_episode[_episode_name(key)] for key in keys]
            out = turn_samples(
                played, slots, self.config.turn_samples, rng, self.tokenizer.eos_token_id, advantages=advantages
            )
            shown = out.pop("shown")
        else:
            out = {
                "prompt_ids": [e.prompt_ids for e in episodes],
                "completion_ids": [e.completion_ids for e in episodes],
                "logprobs": [e.logprobs for e in episodes],
                "env_mask": [e.env_mask for e in episodes],
                "reward_components": [reward_components(e) for e in episodes],
            }
            shown = [e.shown for e in episodes]
        if self.config.constrained_replies:  # the tokens the grammar forced were not the policy's choice
            from lib.episodes.grammar import reply_admitted, train_chosen_tokens_only

            admitted = [
                reply_admitted(self.tokenizer, ids, mask, written)
                for ids, mask, written in zip(out["completion_ids"], out["env_mask"], shown)
            ]
            out["env_mask"] = [
                train_chosen_tokens_only(self.tokenizer, ids, mask, admitted=rows)
                for ids, mask, rows in zip(out["completion_ids"], out["env_mask"], admitted)
            ]
            if self.config.renormalise_to_grammar:  # the trainer scores each token as it was sampled
                registry = admitted_tokens_of(trainer)
                registry.clear()
                for prompt, completion, rows in zip(out["prompt_ids"], out["completion_ids"], admitted):
                    registry.add(prompt, completion, rows)
        return out

    def _play(self, timed: "_TimedGenerate", tasks: List[Dict[str, Any]], seed: int) -> List[PlayedEpisode]:
        """Play `tasks` (one episode each) with the current policy, sampling seeded by `seed`."""
        return play_episodes(
            timed,
            self.tokenizer,
            tasks,
            sampling=self.sampling,
            context=self.config.policy_context,
            observation_config=self.config.observation_config,
            max_turns=self.config.max_turns,
            max_context_tokens=self.config.max_seq_length,
            batch_size=self.config.rollout_batch_size or len(tasks),
            agent_name="policy",
            seed=seed,
        )

    def _resample_alike_groups(
        self,
        timed: "_TimedGenerate",
        tasks: List[Dict[str, Any]],
        episodes: List[PlayedEpisode],
        completed_steps: int,
        first: int,
    ) -> tuple:
        """Dynamic sampling (`TrainConfig.dynamic_sampling`): each group (the episodes of one task)
        whose returns span less than `dynamic_sampling_min_spread` is played again on a fresh task
        of the same kind (`replacement_task`), up to `dynamic_sampling_rounds` rounds, all of a
        round's groups in one lockstep call. Returns the tasks and episodes the step trains on, in
        the same places; a group still alike after the last round is kept as played."""
        tasks, episodes = list(tasks), list(episodes)
        stats = {"step": completed_steps + 1, "groups": 0, "alike_before": 0, "alike_after": 0, "replayed_groups": 0}
        played = len(tasks)
        for round_index in range(self.config.dynamic_sampling_rounds + 1):
            groups = task_groups(tasks)
            alike = [
                places
                for places in groups.values()
                if not group_differs(
                    [episodes[i].record.total_reward for i in places], self.config.dynamic_sampling_min_spread
                )
            ]
            if round_index == 0:
                stats["groups"], stats["alike_before"] = len(groups), len(alike)
            stats["alike_after"] = len(alike)
            if not alike or round_index == self.config.dynamic_sampling_rounds:
                break
            places = [i for group in alike for i in group]
            drawn = stats["replayed_groups"]
            fresh = [
                replacement_task(self.config, tasks[group[0]], completed_steps, drawn + k, process_index())
                for k, group in enumerate(alike)
            ]
            replay = [task for task, group in zip(fresh, alike) for _ in group]
            new = self._play(timed, replay, rollout_sampling_seed(self.config.seed, completed_steps, first + played))
            played += len(replay)
            for i, task, episode in zip(places, replay, new):
                tasks[i], episodes[i] = task, episode
            stats["replayed_groups"] += len(alike)
        self.sampling_stats.append(stats)
        logger.info(
            "dynamic sampling, step %d: %d of %d groups alike (returns spread < %g); %d groups played again; "
            "%d alike after",
            stats["step"],
            stats["alike_before"],
            stats["groups"],
            self.config.dynamic_sampling_min_spread,
            stats["replayed_groups"],
            stats["alike_after"],
        )
        return tasks, episodes


def task_groups(tasks: Sequence[Mapping[str, Any]]) -> Dict[str, List[int]]:
    """The places of each task's episodes (a GRPO group), by the task's JSON, in order."""
    groups: Dict[str, List[int]] = {}
    for i, task in enumerate(tasks):
        groups.setdefault(json.dumps(task, sort_keys=True), []).append(i)
    return groups


def group_differs(returns: Sequence[float], min_spread: float) -> bool:
    """Whether a group's returns span at least `min_spread`: a group that sets a better episode
    against a worse one, which GRPO's advantage can learn from."""
    return len(returns) > 1 and max(returns) - min(returns) >= min_spread


def replacement_task(
    config: TrainConfig, task: Mapping[str, Any], step: int, index: int, process: int = 0
) -> Dict[str, Any]:
    """The fresh task that replaces `task`'s group in dynamic sampling: the same kind (curated
    scenario, or procedural difficulty) on a seed of its own, the `index`-th replacement of
    `step` on `process`; never a seed of the training dataset or of any evaluation."""
    seed = config.train_seed_start + replacement_seed_offset(step, index, process)
    assert_disjoint_from_suite([seed])
    return {**{k: v for k, v in task.items() if k != "seed"}, "seed": seed}


def reward_components(episode: PlayedEpisode) -> Dict[str, float]:
    """An episode's reward, component by component (`REWARD_FUNCS` read one each)."""
    return {name: float(episode.record.reward_components.get(name, 0.0)) for name in COMPONENT_NAMES}


def _episode_name(key: Any) -> str:
    """An episode's name in the step for `lib.training.credit`: "<task JSON>#<place in its
    group>@<process>". With several processes, two may each play the same place of a group for
    the decision slots they hold: two episodes of that task, told apart by the process."""
    task, place = key
    return f"{task}#{place}@{process_index()}"


def turn_samples(
    episodes: Sequence[PlayedEpisode],
    slots: Sequence[int],
    n_slots: int,
    rng: np.random.Generator,
    eos_token_id: int,
    advantages: Optional[Sequence[Mapping[int, float]]] = None,
) -> Dict[str, Any]:
    """The `rollout_func` output of the `turn` context: sample i is decision `slot_turn(...)` of
    `episodes[i]` (its prompt, its reply with the reply's sampling log-probabilities, all of it
    the model's), rewarded with the episode's return. A slot past an episode's last decision is
    an eos-only sample whose mask trains nothing. `advantages[i]` (`credit: decision`): sample i's
    episode's advantage per decision (`lib.training.credit`), written to each sample as
    `ADVANTAGE_FIELD` (0 for an unused slot). `shown[i]`: what sample i's reply could name (`ReplyScope`;
    one entry, or none for an unused slot), which the caller takes out before the trainer sees it."""
    out: Dict[str, List[Any]] = {key: [] for key in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "shown")}
    out["reward_components"] = []
    if advantages is not None:
        out[ADVANTAGE_FIELD] = []
    for i, (episode, slot) in enumerate(zip(episodes, slots)):
        turn = slot_turn(len(episode.turns), slot, n_slots, rng)
        if advantages is not None:
            out[ADVANTAGE_FIELD].append(0.0 if turn is None else float(advantages[i][turn]))
        if turn is None:
            out["prompt_ids"].append([eos_token_id])
            out["completion_ids"].append([eos_token_id])
            out["logprobs"].append([0.0])
            out["env_mask"].append([0])
            out["shown"].append([])
        else:
            played = episode.turns[turn]
            out["prompt_ids"].append(played.prompt_ids)
            out["completion_ids"].append(played.completion_ids)
            out["logprobs"].append(played.logprobs)
            out["env_mask"].append([1] * len(played.completion_ids))
            out["shown"].append([episode.shown[turn]])
        out["reward_components"].append(reward_components(episode))
    return out


class _TimedGenerate:
    """Wraps a `GenerateFn`, adding up its wall time and the tokens it produced."""

    def __init__(self, generate_fn: GenerateFn) -> None:
        self.generate_fn, self.seconds, self.tokens = generate_fn, 0.0, 0

    def __call__(self, contexts: List[List[int]], sampling: Sampling, **kwargs: Any):
        start = time.perf_counter()
        out = self.generate_fn(contexts, sampling, **kwargs)
        self.seconds += time.perf_counter() - start
        self.tokens += sum(len(tokens) for tokens, _ in out)
        return out


def vllm_generate_fn(trainer: Any) -> GenerateFn:
    """`GenerateFn` on TRL's vLLM engine (colocated; weights synced by the trainer before
    each rollout). Sampling settings are the trainer's (temperature, top_p, and
    max_completion_length, which `train` sets to the per-turn `max_new_tokens`). It holds no reply to
    the action grammar (`shown` is not read)."""

    def generate(contexts: List[List[int]], sampling: Sampling, shown: Any = None):
        _, completion_ids, logprobs, _ = trainer.vllm_generation.generate(
            prompts=contexts, images=None, num_generations=1
        )
        eos = trainer.processing_class.eos_token_id if hasattr(trainer.processing_class, "eos_token_id") else None
        out = []
        for ids, lps in zip(completion_ids, logprobs):
            ids = list(ids)
            end = ids.index(eos) + 1 if eos in ids else len(ids)
            out.append((ids[:end], [float(lp[0]) if lp and lp[0] is not None else 0.0 for lp in lps[:end]]))
        return out

    return generate
