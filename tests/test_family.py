"""The heuristic family (a prior that spans strategies), GRPO's exploration settings and dynamic sampling."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from cernenv import ActionType, CERNCollisionEnvironment
from lib.agents.baselines import (
    BEST_FAMILY_MEMBER,
    HEURISTIC_FAMILY,
    HeuristicAgent,
    family_grid,
    family_member,
    member_name,
)
from lib.episodes.agent_rollouts import transitions
from lib.training.config import TrainConfig
from lib.training.grpo import CampaignRollout, group_differs, replacement_task, task_groups, training_tasks


def actions_of(agent, seed=5, scenario=None, difficulty="easy"):
    env = CERNCollisionEnvironment()
    return [action for _, action, _ in transitions(env, agent, seed=seed, scenario=scenario, difficulty=difficulty)]


# the family -----------------------------------------------------------------------------------


def test_the_default_heuristic_is_a_member_of_its_family():
    default = HeuristicAgent().plan_parameters()
    assert set(default) == set(HEURISTIC_FAMILY)
    assert all(default[name] in values for name, values in HEURISTIC_FAMILY.items())
    assert default in family_grid()
    assert member_name(default) == "default"
    assert member_name({**default, "first_block_fraction": 0.7}) == "first_block_fraction=0.7"


def test_the_best_member_is_a_member_that_plays_another_plan_than_the_default():
    best = HeuristicAgent(**BEST_FAMILY_MEMBER)
    assert best.plan_parameters() in family_grid()
    assert member_name(best.plan_parameters()) != "default"
    assert actions_of(best) != actions_of(HeuristicAgent()), "its plan books and claims differently"


def test_family_grid_is_the_product_of_the_ranges():
    grid = family_grid()
    size = 1
    for values in HEURISTIC_FAMILY.values():
        size *= len(values)
    assert len(grid) == size == len({json.dumps(m, sort_keys=True) for m in grid})


def test_a_campaigns_member_is_fixed_by_its_seed_and_the_draws_cover_every_value():
    assert family_member(40_001) == family_member(40_001)
    draws = [family_member(seed) for seed in range(40_000, 40_400)]
    assert json.dumps(draws[0]) != json.dumps(draws[1]) or json.dumps(draws[1]) != json.dumps(draws[2])
    for name, values in HEURISTIC_FAMILY.items():
        assert {draw[name] for draw in draws} == set(values), name
    json.dumps(draws)  # plain Python values


@pytest.mark.parametrize(
    "parameters",
    [{"pileup": "huge"}, {"survey_quality": "perfect"}, {"calibration_passes": 3}, {"first_block_fraction": 0.0}],
)
def test_a_member_outside_the_plans_choices_is_refused(parameters):
    with pytest.raises(ValueError, match=next(iter(parameters))):
        HeuristicAgent(**parameters)


def test_each_parameter_changes_the_play_it_names():
    default = actions_of(HeuristicAgent())

    def first(actions, verb):
        return next(a for a in actions if a.action_type == verb)

    low = actions_of(HeuristicAgent(pileup="low"))
    assert first(low, ActionType.CONFIGURE_BEAM).parameters["pileup"] == "low"
    assert first(default, ActionType.CONFIGURE_BEAM).parameters["pileup"] == "nominal"
    booked = first(actions_of(HeuristicAgent(first_block_fraction=0.7)), ActionType.ALLOCATE_LUMINOSITY)
    assert booked.parameters["luminosity_fb"] == "@luminosity.affordable_fb*0.7"
    standard = actions_of(HeuristicAgent(survey_quality="standard"))
    assert {a.parameters["quality"] for a in standard if a.action_type == ActionType.RECONSTRUCT_TRACKS} == {"standard"}

    def count(actions, verb):
        return sum(a.action_type == verb for a in actions)

    assert count(default, ActionType.CALIBRATE_DETECTOR) == 2
    assert count(actions_of(HeuristicAgent(calibration_passes=1)), ActionType.CALIBRATE_DETECTOR) == 1
    # a campaign short of an observation after the first block books once more, unless told not to
    seed = next(
        s
        for s in range(20)
        if count(actions_of(HeuristicAgent(), seed=s, difficulty="hard"), ActionType.ALLOCATE_LUMINOSITY) == 2
    )
    once = actions_of(HeuristicAgent(second_booking=False), seed=seed, difficulty="hard")
    assert count(once, ActionType.ALLOCATE_LUMINOSITY) == 1


@pytest.mark.parametrize("index", [0, 37, 101, 199])
def test_family_members_play_to_a_graded_claim(index):
    member = family_grid()[index]
    actions = actions_of(HeuristicAgent(**member), seed=11, difficulty="medium")
    assert actions[-1].action_type == ActionType.SUBMIT_DISCOVERY_CLAIM


def test_family_demonstrations_follow_each_campaigns_member(tokenizer):
    from lib.training.warm_start import demonstration_examples

    seed = next(s for s in range(40_000, 40_100) if family_member(s)["first_block_fraction"] != 0.4)
    spec = [{"seed": seed, "scenario": None, "difficulty": "easy"}]
    plain = demonstration_examples(tokenizer, 1, loss="actions", context="turn", specs=spec)
    family = demonstration_examples(tokenizer, 1, loss="actions", context="turn", specs=spec, demonstrators="family")
    assert plain != family
    fraction = f"*{family_member(seed)['first_block_fraction']:g}"
    assert any(fraction in tokenizer.decode(example["input_ids"]) for example in family)
    with pytest.raises(ValueError, match="demonstrators"):
        demonstration_examples(tokenizer, 1, specs=spec, demonstrators="oracle")


# exploration settings ---------------------------------------------------------------------------


def test_grpo_args_carry_the_exploration_settings(tmp_path):
    from lib.training.run import grpo_args

    config = TrainConfig(
        output_dir=str(tmp_path),
        epsilon_high=0.28,
        entropy_coef=0.01,
        use_adaptive_entropy=True,
        entropy_target=0.3,
        top_entropy_quantile=0.2,
    )
    args = grpo_args(config)
    assert (args.epsilon, args.epsilon_high, args.entropy_coef) == (0.2, 0.28, 0.01)
    assert (args.use_adaptive_entropy, args.entropy_target, args.top_entropy_quantile) == (True, 0.3, 0.2)
    assert grpo_args(TrainConfig(output_dir=str(tmp_path))).epsilon_high is None  # TRL: the lower bound


def test_clip_higher_is_said_to_change_nothing_where_every_sample_is_trained_once(tmp_path, caplog):
    from lib.training.run import grpo_args, samples_trained_once

    config = TrainConfig(output_dir=str(tmp_path), epsilon_high=0.28)
    with caplog.at_level("WARNING", logger="lib.training.run"):
        args = grpo_args(config)
    assert samples_trained_once(args)
    assert "the clip never binds" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="lib.training.run"):
        reused = grpo_args(config, num_iterations=2)
    assert not samples_trained_once(reused) and "never binds" not in caplog.text
    reused = grpo_args(config, steps_per_generation=2 * args.gradient_accumulation_steps)
    assert not samples_trained_once(reused)


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"epsilon_high": 0.1}, "epsilon_high"),
        ({"top_entropy_quantile": 1.5}, "top_entropy_quantile"),
        ({"entropy_coef": -0.1}, "entropy_coef"),
        ({"dynamic_sampling_rounds": 0}, "dynamic_sampling_rounds"),
        ({"dynamic_sampling_min_spread": 0.0}, "dynamic_sampling_min_spread"),
        ({"warm_start_demonstrators": "oracle"}, "warm_start_demonstrators"),
        ({"dynamic_sampling": True, "train_seed_start": 850_000}, "evaluation seed"),
    ],
)
def test_exploration_settings_out_of_range_are_refused(fields, problem):
    with pytest.raises(ValueError, match=problem):
        TrainConfig(**fields)


# dynamic sampling -----------------------------------------------------------------------------------


def test_a_group_differs_when_its_returns_span_the_threshold():
    assert group_differs([3.0, -1.0, 3.0], 1.0)
    assert not group_differs([3.0, 3.05, 2.9], 1.0)
    assert not group_differs([4.0], 1.0)


def test_task_groups_collect_the_places_of_each_task():
    tasks = [{"seed": 1, "difficulty": "easy"}, {"difficulty": "easy", "seed": 1}, {"seed": 2, "difficulty": "easy"}]
    assert list(task_groups(tasks).values()) == [[0, 1], [2]]


def test_a_replacement_task_is_of_the_same_kind_on_a_seed_of_its_own():
    config = TrainConfig()
    dataset_seeds = {t["seed"] for t in training_tasks(config, config.max_steps * 8)}
    curated = {"seed": 100_003, "scenario": "higgs_diphoton_125", "difficulty": None}
    new = replacement_task(config, curated, step=2, index=5)
    assert {k: v for k, v in new.items() if k != "seed"} == {"scenario": "higgs_diphoton_125", "difficulty": None}
    assert new == replacement_task(config, curated, step=2, index=5)  # a resumed run replays the same
    seeds = {
        replacement_task(config, curated, step, i, p)["seed"] for step in range(8) for i in range(20) for p in (0, 1)
    }
    assert len(seeds) == 8 * 20 * 2 and not seeds & dataset_seeds
    with pytest.raises(ValueError, match="reserves"):
        replacement_task(config, curated, step=0, index=10_000)


class ScriptedRollout(CampaignRollout):
    """A CampaignRollout whose episodes are scripted: each task's return is read from `returns`
    by its seed (a list: one per place in the group; a seed missing there scores 0 everywhere)."""

    def __init__(self, config, returns):
        super().__init__(config, tokenizer=None)
        self.returns, self.plays = returns, []

    def _play(self, timed, tasks, seed):
        self.plays.append([dict(t) for t in tasks])
        episodes, seen = [], {}
        for task in tasks:
            place = seen.setdefault(task["seed"], 0)
            seen[task["seed"]] += 1
            score = self.returns.get(task["seed"], [0.0] * 64)[place]
            episodes.append(SimpleNamespace(record=SimpleNamespace(total_reward=score), task=task))
        return episodes


def test_dynamic_sampling_plays_alike_groups_again_on_fresh_tasks_in_their_places():
    config = TrainConfig(dynamic_sampling=True, dynamic_sampling_rounds=2, num_generations=4)
    tasks = [{"seed": 1, "scenario": None, "difficulty": "easy"}] * 4 + [
        {"seed": 2, "scenario": None, "difficulty": "hard"}
    ] * 4
    first_replacement = replacement_task(config, tasks[4], 0, 0)["seed"]
    rollout = ScriptedRollout(config, {1: [3.0, -1.0, 3.0, 3.0], first_replacement: [4.0, 3.0, 4.0, -3.0]})
    episodes = rollout._play(None, tasks, 0)
    new_tasks, new_episodes = rollout._resample_alike_groups(None, tasks, episodes, 0, 0)
    assert new_tasks[:4] == tasks[:4] and new_episodes[:4] == episodes[:4]  # a differing group stays
    assert [t["seed"] for t in new_tasks[4:]] == [first_replacement] * 4
    assert {t["difficulty"] for t in new_tasks[4:]} == {"hard"}
    assert [e.record.total_reward for e in new_episodes[4:]] == [4.0, 3.0, 4.0, -3.0]
    assert len(rollout.plays) == 2 and len(rollout.plays[1]) == 4  # one replacement round of one group
    assert rollout.sampling_stats == [
        {"step": 1, "groups": 2, "alike_before": 1, "alike_after": 0, "replayed_groups": 1}
    ]


def test_dynamic_sampling_stops_after_its_rounds():
    config = TrainConfig(dynamic_sampling=True, dynamic_sampling_rounds=2, num_generations=2)
    tasks = [{"seed": 1, "scenario": None, "difficulty": "easy"}] * 2
    rollout = ScriptedRollout(config, {})  # every group scores alike, however often it is replaced
    new_tasks, _ = rollout._resample_alike_groups(None, tasks, rollout._play(None, tasks, 0), 3, 0)
    assert len(rollout.plays) == 1 + 2
    assert new_tasks[0]["seed"] == replacement_task(config, tasks[0], 3, 1)["seed"]  # the last round's
    assert rollout.sampling_stats[-1] == {
        "step": 4,
        "groups": 1,
        "alike_before": 1,
        "alike_after": 1,
        "replayed_groups": 2,
    }


def test_dynamic_sampling_in_the_real_rollout_keeps_every_sample_in_its_place(tiny_model_dir):
    """The turn context, played by a model: with a spread no group reaches, every group is played
    again `dynamic_sampling_rounds` times on fresh tasks; the step still returns one sample per
    row, each from an episode of its row's replacement task, and the reward log counts the
    episodes trained on."""
    from transformers import AutoModelForCausalLM

    from lib.training.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)

    class FakeTrainer:
        use_vllm = False
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)

        class accelerator:
            unwrap_model = staticmethod(lambda m: m)

    config = TrainConfig(
        max_turns=2,
        max_new_tokens=8,
        num_generations=2,
        turn_samples=2,
        dynamic_sampling=True,
        dynamic_sampling_rounds=1,
        dynamic_sampling_min_spread=1e6,
    )
    tasks = [{"seed": 7, "scenario": None, "difficulty": "easy"}, {"seed": 8, "scenario": None, "difficulty": "hard"}]
    prompts = [json.dumps({**task, "turn_slot": slot}) for task in tasks for slot in range(2) for _ in range(2)]
    rollout = CampaignRollout(config, tokenizer)
    out = rollout(prompts, FakeTrainer())
    assert len(out["prompt_ids"]) == len(prompts) == 8
    assert rollout.sampling_stats == [
        {"step": 1, "groups": 2, "alike_before": 2, "alike_after": 2, "replayed_groups": 2}
    ]
    seeds = [e.record.seed for e in rollout.last_episodes]
    assert (
        seeds
        == [replacement_task(config, tasks[0], 0, 0)["seed"]] * 2
        + [replacement_task(config, tasks[1], 0, 1)["seed"]] * 2
    )
    assert [e.record.difficulty for e in rollout.last_episodes] == ["easy", "easy", "hard", "hard"]
    for i in range(8):  # sample i: decision slot (i // 2) % 2 of episode i % 2 of its task's group
        episode = rollout.last_episodes[2 * (i // 4) + i % 2]
        assert sum(out["reward_components"][i].values()) == pytest.approx(episode.record.total_reward)


def test_the_family_bench_varies_each_parameter_alone_and_counts_contrast():
    from bench.bench_family import axes_members, contrast

    members = axes_members()
    default = HeuristicAgent().plan_parameters()
    assert members[0] == default and len({json.dumps(m, sort_keys=True) for m in members}) == len(members)
    for member in members[1:]:
        changed = {name for name in member if member[name] != default[name]}
        assert changed and (len(changed) == 1 or changed == {"discovery_z_global", "first_block_fraction"})
    assert contrast([[True, True, False], [True, False, False]]) == pytest.approx(1 / 3)


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_grpo_s_learning_rate_follows_its_schedule_over_the_run(tmp_path, schedule):
    """GRPO's learning rate at each of 8 steps, from the scheduler transformers builds from `grpo_args`:
    constant at its value, or decaying from it to 0 by the last step with no warm-up."""
    import torch
    from transformers import get_scheduler

    from lib.training.run import grpo_args

    args = grpo_args(TrainConfig(output_dir=str(tmp_path), learning_rate=4e-5, max_steps=8, lr_schedule=schedule))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate)
    scheduler = get_scheduler(
        args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps, num_training_steps=args.max_steps
    )
    rates = []
    for _ in range(args.max_steps):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert rates[0] == pytest.approx(4e-5), "no warm-up: the first step takes the whole rate"
    if schedule == "constant":
        assert rates == pytest.approx([4e-5] * 8)
    else:
        assert all(a > b for a, b in zip(rates, rates[1:])), rates
        assert rates[-1] < 0.2 * 4e-5 and scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)


def test_an_unknown_grpo_schedule_is_refused_with_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"lr_schedule must be one of \('constant', 'cosine', 'linear'\), got 'step'"):
        TrainConfig(output_dir=str(tmp_path), lr_schedule="step")
