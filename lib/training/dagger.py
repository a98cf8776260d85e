"""DAgger for the warm start (Ross, Gordon and Bagnell 2011): the demonstrator labels the states
the learner itself reaches.

Plain imitation trains on the states the heuristic reaches. Once the learner errs (a refused
action, a repeat, a half-built analysis) it stands where no demonstration ever stood, and nothing
taught it how to recover. `HeuristicAgent` decides from the rendered observation alone, so it
can label any state. Each round:

1. the learner plays `warm_start_dagger_episodes` training campaigns (from `DAGGER_SEED`, at the
   training `sampling`: the states GRPO's rollouts will see);
2. each campaign is replayed from its seed with the learner's own actions, and at every decision
   the demonstrator (`RoundedDemonstrator(HeuristicAgent())`) writes what it would have done;
3. the learner trains (TRL's `SFTTrainer`, as the warm start, one pass) on those labelled
   decisions together with as many of the demonstrations' own decisions (the aggregation of
   DAgger: it keeps the demonstrator's states too). `lib.training.warm_start.dagger_rounds` runs
   the rounds after the warm start's imitation (`TrainConfig.warm_start_dagger_rounds`).

Only the `turn` context is supported: a decision's prompt is its own observation, so a label is
one example. The report says how often the learner already did what the demonstrator would have
(`agreement`): the share of its mistakes the round can teach.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import numpy as np

from lib.agents.baselines import HeuristicAgent, RoundedDemonstrator
from lib.agents.prompting import action_to_json, build_chat
from lib.episodes.chat import ChatLayout
from lib.episodes.generation import hf_generate_fn
from lib.episodes.llm_rollouts import play_episodes
from lib.episodes.records import as_episode_dict, step_refused
from lib.report.replay import environment_for, reset_for
from lib.training.config import TrainConfig
from lib.training.tokenizer import corpus_specs


def labelled_learner_decisions(
    policy: Any, config: TrainConfig, n_episodes: int, first_seed: int
) -> Tuple[List[Dict[str, List[int]]], Dict[str, float]]:
    """The learner's decisions on `n_episodes` training campaigns from `first_seed`, each labelled
    with the demonstrator's action for the observation it read, as warm-start examples
    ({"input_ids", "completion_mask"}, laid out as `demonstration_examples` lays out the `turn`
    context); and what the round saw: decisions, the share where the learner's reply was already
    the label (`agreement`), the share of its actions refused, the campaigns it won."""
    if config.policy_context != "turn":
        raise ValueError(
            f"DAgger labels single decisions: it needs policy_context 'turn', not {config.policy_context!r}"
        )
    tokenizer = policy.tokenizer
    specs = corpus_specs(n_episodes, first_seed)
    generate = hf_generate_fn(policy.model, tokenizer, config.generation_engine)
    played = play_episodes(
        generate,
        tokenizer,
        specs,
        sampling=config.sampling,
        context="turn",
        observation_config=config.observation_config,
        max_turns=config.max_turns,
        max_context_tokens=config.max_seq_length,
        batch_size=config.rollout_batch_size or 16,
        agent_name="learner",
        seed=first_seed,
        progress="DAgger: the learner's campaigns",
    )
    examples, agreed, refused = label_decisions([episode.record for episode in played], tokenizer, config)
    n = max(1, len(examples))
    stats = {
        "campaigns": float(len(played)),
        "decisions": float(len(examples)),
        "agreement": agreed / n,
        "refused": refused / n,
        "success": float(np.mean([bool(e.record.correct_outcome) for e in played])) if played else 0.0,
    }
    return examples, stats


def label_decisions(
    records: List[Any], tokenizer: Any, config: TrainConfig
) -> Tuple[List[Dict[str, List[int]]], int, int]:
    """Every decision of `records` (played episodes) as a warm-start example: the observation the
    player read (the episode replayed from its seed with its own actions) and the demonstrator's
    action there. Returns the examples, how many of the player's replies were the label already,
    and how many of its actions were refused."""
    layout = ChatLayout(tokenizer, config.observation_config)
    demonstrator = RoundedDemonstrator(HeuristicAgent())
    eos = tokenizer.eos_token_id
    loss_on_prompt = int(config.warm_start_loss == "conversation")
    examples, agreed, refused = [], 0, 0
    for record in records:
        record = as_episode_dict(record)
        env = environment_for(record)
        obs = reset_for(env, record)
        for step in record["steps"]:
            label = action_to_json(demonstrator.act(obs), justification=False)
            agreed += step["completion"].strip() == label
            refused += step_refused(step)
            prompt_ids = layout.prompt_ids(build_chat(obs, config.observation_config))
            reply_ids = tokenizer(label, add_special_tokens=False)["input_ids"] + [eos]
            examples.append(
                {
                    "input_ids": prompt_ids + reply_ids,
                    "completion_mask": [loss_on_prompt] * len(prompt_ids) + [1] * len(reply_ids),
                }
            )
            obs = env.step(step["action"])
    return examples, agreed, refused
