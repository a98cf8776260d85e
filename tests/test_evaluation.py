"""The held-out suite and the bootstrap metrics."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from cernenv.scenarios import DIFFICULTIES, EVALUATION_SEED_START, list_scenarios
from lib.measure.evaluation import (
    GROUPS,
    HELDOUT_SEED_START,
    PARTS,
    PUBLISHED_KEY,
    SUITE_VERSION,
    assert_disjoint_from_suite,
    baseline_groups_from_json,
    episode_groups,
    group_metrics,
    heldout_suite,
    part_of,
    split_comparison_table,
    write_baseline_evidence,
)
from lib.measure.metrics import agent_metrics, bootstrap_mean, comparison_table, paired_difference


def test_suite_is_fixed_large_and_spans_everything():
    suite = heldout_suite()
    assert suite == heldout_suite("v3") and SUITE_VERSION == "v3"
    assert len({s.seed for s in suite}) == len(suite)
    assert {s.scenario for s in suite if s.scenario} == set(list_scenarios())
    assert {s.difficulty for s in suite if s.difficulty} == set(DIFFICULTIES)
    assert min(s.seed for s in suite) >= HELDOUT_SEED_START
    env = PUBLISHED_KEY.make_env()
    unseen = Counter()
    for spec in suite:
        env.reset(seed=spec.seed, scenario=spec.scenario, difficulty=spec.difficulty)
        if spec.part == "unseen":
            unseen[env.hidden_truth()["exists"]] += 1
    # a 0.10 success difference on the unseen particles has a 95% interval of about ±0.10 or less:
    # the worst case of two independent success rates of 0.5 needs 1.96·√(0.5/n) <= 0.10, n >= 192
    assert unseen[True] >= 192
    assert unseen[False] >= 40, "a null part"


def test_suites_v1_and_v2_are_unchanged_so_old_evidence_stays_readable():
    v1 = heldout_suite("v1")
    assert len(v1) == 120 and [s.seed for s in v1] == list(range(900_000, 900_120))
    assert v1[0].scenario == list_scenarios()[0] and v1[41].scenario == list_scenarios()[-1]
    assert v1[42].difficulty == "easy" and v1[-1].difficulty == "hard"
    assert Counter(s.scenario for s in v1 if s.scenario) == {name: 6 for name in list_scenarios()}
    assert Counter(s.difficulty for s in v1 if s.difficulty) == {d: 26 for d in DIFFICULTIES}
    v2 = heldout_suite("v2")
    assert [s.seed for s in v2] == list(range(901_000, 901_121))


def test_suite_v3_has_its_own_seeds_and_reports_known_physics_apart():
    v3 = heldout_suite("v3")
    assert HELDOUT_SEED_START == EVALUATION_SEED_START
    assert [s.seed for s in v3] == list(range(902_000, 902_313)), "contiguous evaluation seeds"
    assert not {s.seed for s in v3} & {s.seed for version in ("v1", "v2") for s in heldout_suite(version)}
    known = [s for s in v3 if s.part == "known_physics"]
    unseen = [s for s in v3 if s.part == "unseen"]
    assert Counter(s.scenario for s in known) == {name: 4 for name in list_scenarios()}
    assert Counter(s.difficulty for s in unseen) == {d: 95 for d in DIFFICULTIES}
    assert all(s.scenario is None for s in unseen) and all(s.difficulty is None for s in known)
    assert part_of("procedural_easy") == "unseen" and part_of("z_mumu_91") == "known_physics"
    assert "not generalisation" in PARTS["known_physics"]


def test_unknown_version_and_overlapping_training_seeds_are_refused():
    with pytest.raises(ValueError, match="'v1', 'v2', 'v3'"):
        heldout_suite("v0")
    assert_disjoint_from_suite(range(1000))
    assert_disjoint_from_suite(range(HELDOUT_SEED_START - 10, HELDOUT_SEED_START))
    with pytest.raises(ValueError, match="overlap"):
        assert_disjoint_from_suite([HELDOUT_SEED_START + 3])
    with pytest.raises(ValueError, match=f"below {HELDOUT_SEED_START}"):
        assert_disjoint_from_suite([5, HELDOUT_SEED_START + 50_000])  # in no suite, but an evaluation seed


def test_bootstrap_interval_covers_the_true_mean_at_about_95_percent():
    rng = np.random.default_rng(0)
    covered = 0
    for i in range(200):
        est = bootstrap_mean(rng.binomial(1, 0.3, size=120), seed=i)
        covered += est.low <= 0.3 <= est.high
    assert 0.89 <= covered / 200 <= 0.99


def test_bootstrap_edge_cases():
    assert bootstrap_mean([]).n == 0
    constant = bootstrap_mean([1.0, 1.0, 1.0])
    assert constant.mean == constant.low == constant.high == 1.0
    wide, narrow = bootstrap_mean(np.arange(10.0)), bootstrap_mean(np.tile(np.arange(10.0), 20))
    assert wide.high - wide.low > narrow.high - narrow.low


def _episode(seed, reward, correct, exists=True, discovered=True, mass=True):
    return {
        "seed": seed,
        "scenario": None,
        "difficulty": "easy",
        "cumulative_reward": reward,
        "correct_outcome": correct,
        "truth": {"exists": exists},
        "discovered": discovered,
        "correct_mass": mass if exists else None,
        "correct_channel": mass if exists else None,
        "correct_spin": None,
        "steps": [{"parsed_ok": True}, {"parsed_ok": False}],
        "n_steps": 2,
        "resources": {
            "budget_used_musd": 30.0,
            "budget_remaining_musd": 70.0,
            "time_used_days": 10.0,
            "time_remaining_days": 90.0,
        },
    }


def test_metrics_on_a_hand_made_sample():
    episodes = [
        _episode(0, 4.0, True),
        _episode(1, -2.0, False, mass=False),
        _episode(2, 3.0, True, exists=False, discovered=False),
        _episode(3, -3.0, False, exists=False),
    ]
    m = agent_metrics(episodes)
    assert m["mean_reward"].mean == pytest.approx(0.5)
    assert m["success_rate"].mean == pytest.approx(0.5)
    assert m["mass_accuracy"].mean == pytest.approx(0.5) and m["mass_accuracy"].n == 2
    assert m["false_discovery_rate"].mean == pytest.approx(0.5) and m["false_discovery_rate"].n == 2
    assert m["parse_rate"].mean == pytest.approx(0.5)
    assert m["budget_used_fraction"].mean == pytest.approx(0.3)
    table = comparison_table({"a": m})
    assert table.splitlines()[0].startswith("| agent | mean_reward") and "| a | 0.5 [" in table


def test_paired_difference_detects_a_clear_improvement_and_needs_the_same_episodes():
    rng = np.random.default_rng(1)
    base = rng.normal(0, 2, size=120)
    before = [_episode(i, float(r), False) for i, r in enumerate(base)]
    after = [_episode(i, float(r) + 1.0 + rng.normal(0, 0.3), True) for i, r in enumerate(base)]
    diff = paired_difference(before, after, "mean_reward")
    assert diff.low > 0.8 and diff.high < 1.2
    same = paired_difference(before, before, "mean_reward")
    assert same.mean == same.low == same.high == 0.0
    with pytest.raises(ValueError, match="same episodes"):
        paired_difference(before, after[:-1], "mean_reward")
    with pytest.raises(ValueError, match="each once"):  # a task twice on one side cannot be paired
        paired_difference(before, after[:-1] + after[:1], "mean_reward")


def _split_sample():
    """10 episodes: 6 procedural (4 with a particle, 1 of them correct; 2 null, 1 correct),
    3 curated (2 with a particle, both correct; 1 null, wrong) and a record without a truth."""

    def ep(seed, scenario, exists, correct, reward):
        return dict(
            _episode(seed, reward, correct, exists=exists, discovered=correct if exists else not correct),
            scenario=scenario,
        )

    episodes = [
        ep(0, "procedural_easy", True, True, 4.0),
        ep(1, "procedural_easy", True, False, -2.0),
        ep(2, "procedural_hard", True, False, -2.0),
        ep(3, "procedural_hard", True, False, -1.0),
        ep(4, "procedural_medium", False, True, 3.0),
        ep(5, "procedural_medium", False, False, -3.0),
        ep(6, "higgs_diphoton_125", True, True, 5.0),
        ep(7, "z_mumu_91", True, True, 5.0),
        ep(8, "null_diphoton_750", False, False, -1.0),
    ]
    no_truth = dict(ep(9, "procedural_easy", True, True, 1.0))
    del no_truth["truth"]
    return episodes + [no_truth]


def test_groups_split_the_suite_by_part_and_by_particle():
    groups = episode_groups(_split_sample())
    assert list(groups) == list(GROUPS)
    seeds = {name: [e["seed"] for e in group] for name, group in groups.items()}
    assert seeds["all"] == list(range(10))
    assert seeds["unseen"] == [0, 1, 2, 3, 4, 5, 9] and seeds["known_physics"] == [6, 7, 8]
    assert seeds["unseen_with_particle"] == [0, 1, 2, 3] and seeds["unseen_null"] == [4, 5]
    assert seeds["known_physics_with_particle"] == [6, 7] and seeds["known_physics_null"] == [8]
    assert seeds["with_particle"] == [0, 1, 2, 3, 6, 7] and seeds["null"] == [4, 5, 8], "no truth: neither"
    metrics = group_metrics(_split_sample())
    assert metrics["unseen_with_particle"]["success_rate"].mean == pytest.approx(0.25)
    assert metrics["unseen_with_particle"]["mean_reward"].mean == pytest.approx(-0.25)
    assert metrics["unseen_null"]["success_rate"].mean == pytest.approx(0.5)
    assert metrics["unseen_null"]["false_discovery_rate"].mean == pytest.approx(0.5)
    assert metrics["known_physics"]["success_rate"].mean == pytest.approx(2 / 3)
    assert metrics["known_physics_null"]["mass_accuracy"].n == 0
    assert metrics["unseen"]["success_rate"].n == 7 and metrics["unseen"]["success_rate"].mean == pytest.approx(3 / 7)
    table = split_comparison_table({g: {"a": m} for g, m in metrics.items() if g != "all"})
    assert "| unseen particles, with a particle | a | 1 of 4 | -0.25 [" in table
    assert "| known physics (recall), null tasks | a | 0 of 1 | -1 [-1, -1] | 0 [0, 0] | — |" in table


def test_baseline_evidence_reports_every_group_and_old_files_still_load(tmp_path):
    write_baseline_evidence({"a": _split_sample(), "b": _split_sample()[:3]}, tmp_path)
    payload = json.loads((tmp_path / "baselines.json").read_text())
    assert payload["suite_version"] == SUITE_VERSION and payload["metrics"]["a"]["success_rate"]["n"] == 10
    assert set(payload["groups"]) == set(GROUPS) - {"all"}
    assert payload["groups"]["unseen_null"]["n_episodes"] == {"a": 2, "b": 0}
    assert payload["groups"]["unseen_null"]["metrics"]["a"]["success_rate"]["mean"] == 0.5
    groups = baseline_groups_from_json(payload)
    assert groups["known_physics"]["a"]["mean_reward"].mean == pytest.approx(3.0)
    markdown = (tmp_path / "baselines.md").read_text()
    assert "| unseen particles, null tasks | a | 1 of 2 |" in markdown
    assert "| unseen particles, null tasks | b | — |" in markdown
    old = {key: value for key, value in payload.items() if key != "groups"}
    assert baseline_groups_from_json(old) == {}


def _particle(scenario):
    truth = scenario.truth
    channels = frozenset(ch for ch, xs in truth.sigma_br_fb.items() if xs > 0)
    return truth.mass_gev, channels, truth.spin


@pytest.mark.slow
def test_no_training_task_produces_an_unseen_particle_within_two_mass_resolutions():
    """30,000 training seeds of the procedural generator (and the curated particles, which
    training plays too) against every unseen particle of the suite and 3,000 more evaluation
    seeds under random keys: no pair sharing a decay channel is within 2σ_m, σ_m the standard
    analysis's resolution in that channel at the heavier of the two masses (whatever the spins)."""
    from cernenv.detector import CHANNELS, mass_resolution_gev
    from cernenv.scenarios import CURATED, procedural_scenario

    training = [_particle(s) for s in CURATED.values() if s.truth is not None]
    for seed in range(30_000):
        scenario = procedural_scenario(seed, DIFFICULTIES[seed % 3])
        if scenario.truth is not None:
            training.append(_particle(scenario))
    assert len(training) > 20_000
    unseen = []
    for index, spec in enumerate(heldout_suite()):
        if spec.part == "unseen":
            for salt in (PUBLISHED_KEY.salt, f"random key {index}"):
                scenario = procedural_scenario(spec.seed, spec.difficulty, salt)
                if scenario.truth is not None:
                    unseen.append(_particle(scenario))
    for seed in range(HELDOUT_SEED_START + 100_000, HELDOUT_SEED_START + 103_000):
        scenario = procedural_scenario(seed, DIFFICULTIES[seed % 3], f"key {seed}")
        if scenario.truth is not None:
            unseen.append(_particle(scenario))
    masses = np.array([mass for mass, _, _ in training])
    by_channel = {ch: np.array([c and ch in c for _, c, _ in training]) for ch in CHANNELS}
    closest = np.inf
    for mass, channels, _ in unseen:
        for channel in channels:
            others = masses[by_channel[channel]]
            nearest = others[np.argmin(np.abs(others - mass))]
            sigma = float(mass_resolution_gev(CHANNELS[channel], max(mass, nearest), 1, "standard", "nominal"))
            closest = min(closest, abs(nearest - mass) / sigma)
    print(f"\n{len(unseen)} unseen particles, {len(training)} training ones: closest pair {closest:.2f} σ_m apart")
    assert closest > 2.0
