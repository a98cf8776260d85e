"""Replies held to the action grammar (`Sampling.constrained`, lib/episodes/grammar.py): every reply
a model ends is one schema-valid action, the demonstrations stay writable, and the log-probabilities
returned are still what the trainer scores."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from cernenv import CERNCollisionEnvironment
from cernenv.rules import RuleViolation, parse_action
from lib.agents.baselines import HeuristicAgent
from lib.agents.prompting import ReplyScope, Sampling, _json_objects, action_to_json
from lib.episodes.generation import hf_generate_fn
from lib.episodes.grammar import action_grammar
from lib.episodes.llm_rollouts import play_episodes

SPECS = [(21, None, "easy"), (22, "higgs_4l_125", None), (23, None, "hard"), (24, None, "medium")]


@pytest.mark.parametrize("engine", ["cached", "generate"])
@pytest.mark.parametrize("temperature", [0.0, pytest.param(1.0, marks=pytest.mark.slow)])
def test_every_reply_a_random_model_writes_is_held_to_the_grammar(tokenizer, model, engine, temperature):
    """A random-weight model, held to the grammar: each reply it ends (an eos within max_new_tokens) is
    exactly one JSON object, written compactly, that the environment's own parser accepts as an
    action, or refuses only for what the schema cannot state (a rule between fields: a discovery
    claim needs a mass; the type of the value a reference names); each reply cut at max_new_tokens
    (a random model may write a free-text justification to its length limit) is a prefix the grammar
    still accepts. Whether a random model ends a reply within the limit depends on its weights and
    the tokenizer's vocabulary, so no count of ended replies is asserted, only that every reply is
    one or the other."""
    max_new_tokens = 64
    sampling = Sampling(temperature=temperature, max_new_tokens=max_new_tokens, constrained=True)
    episodes = play_episodes(
        hf_generate_fn(model, tokenizer, engine), tokenizer, SPECS[:3], sampling=sampling, max_turns=2, seed=3
    )
    grammar = action_grammar(tokenizer, len(tokenizer))
    replies = 0
    for (seed, scenario, difficulty), episode in zip(SPECS, episodes):
        task = CERNCollisionEnvironment().reset(seed=seed, scenario=scenario, difficulty=difficulty).task
        assert all(
            isinstance(s, ReplyScope) and s.offered == ReplyScope({}, task.offered_options()).offered
            for s in episode.shown
        )  # each reply was held to its task's options
        checked_shown: list = []
        runs, previous = [], 0  # the model's replies: the runs of its own tokens between the environment's
        for token, mine in zip(episode.completion_ids, episode.env_mask):
            if mine and not previous:
                runs.append([])
            if mine:
                runs[-1].append(token)
            previous = mine
        assert len(runs) == len(episode.record.steps)
        for run, step in zip(runs, episode.record.steps):
            replies += 1
            completion = step["completion"] if isinstance(step, dict) else step.completion
            if run[-1] != tokenizer.eos_token_id:  # cut at max_new_tokens: a prefix of an action
                checked_shown.append(None)
                assert len(run) == max_new_tokens
                matcher = grammar.matcher()
                assert matcher.consume_tokens(run) and not matcher.is_error(), completion
                continue
            objects = _json_objects(completion)
            assert len(objects) == 1, completion
            assert json.loads(completion) == objects[0], completion  # the one object is the whole reply
            outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', completion)
            assert not re.search(r"\s", outside_strings), completion  # written compactly (a number may
            # hold more digits than a float keeps, so the text is not compared with json.dumps of it)
            quoted = [v for v in objects[0].get("parameters", {}).values() if isinstance(v, str) and v[:1] == "@"]
            shown = episode.shown[len(checked_shown)]
            assert all(re.sub(r"\*.*$", "", v[1:]) in shown for v in quoted), (completion, sorted(shown))
            checked_shown.append(completion)
            try:
                parse_action(objects[0], shown)
            except RuleViolation as refusal:  # only what a JSON schema of the values shown cannot
                # state: a rule between fields (a discovery claim needs a mass), or a quoted value
                # (scaled by any factor) outside its parameter's range; never a type
                cross_field = "Value error" in str(refusal) and "is not a reference" not in str(refusal)
                out_of_range = quoted and re.search(r"Input should be (less|greater) than", str(refusal))
                assert cross_field or out_of_range, refusal
    assert replies >= len(SPECS[:3])


def test_the_demonstrations_are_writable_under_the_grammar(tokenizer):
    """Every reply the warm start teaches (the heuristic's actions as `action_to_json` writes them,
    without the justification, then eos) is allowed token by token under the grammar of the
    references its observation shows and the options its task offers: the constraint never forbids
    what the policy learned."""
    env, agent = CERNCollisionEnvironment(), HeuristicAgent()
    checked = 0
    for seed in range(100_000, 100_012):
        obs = env.reset(seed=seed, difficulty=("easy", "medium", "hard")[seed % 3])
        agent.reset()
        while not obs.done:
            action = agent.act(obs)
            matcher = action_grammar(tokenizer, len(tokenizer), ReplyScope.of(obs)).matcher()
            ids = tokenizer(action_to_json(action, justification=False), add_special_tokens=False)["input_ids"]
            for token in ids + [tokenizer.eos_token_id]:
                assert matcher.consume_token(token), (action_to_json(action, justification=False), matcher.get_error())
            assert matcher.is_stopped()
            checked += 1
            obs = env.step(action)
    assert checked >= 100


@pytest.mark.parametrize("engine", ["cached", "generate"])
def test_constrained_sampling_returns_the_log_probabilities_the_trainer_scores(tokenizer, model, engine):
    """TRL scores log_softmax(logits / T) over the whole vocabulary; the constraint only chooses which
    tokens may be drawn, so the numbers returned with a constrained sample are those."""
    temperature = 0.6
    [episode] = play_episodes(
        hf_generate_fn(model, tokenizer, engine),
        tokenizer,
        [(8, None, "hard")],
        sampling=Sampling(temperature=temperature, max_new_tokens=24, constrained=True),
        max_turns=1,
        seed=5,
    )
    assert tokenizer.decode(episode.completion_ids).startswith('{"action_type":"'), "the grammar held the reply"
    ids = torch.tensor([episode.prompt_ids + episode.completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(episode.prompt_ids) - 1 : -1].float() / temperature
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(episode.completion_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(episode.logprobs), expected, atol=1e-4)


def test_restrict_masks_what_llguidance_masks(tokenizer):
    """`ActionGrammar.restrict` unpacks the matchers' bitmasks itself: the same -inf entries as
    llguidance's own `apply_token_bitmask_inplace`, row by row, a finished reply's row untouched."""
    import llguidance.torch

    grammar = action_grammar(tokenizer, len(tokenizer))
    reply = tokenizer('{"action_type":"configure_beam","parameters":{"beam_energy_tev":13', add_special_tokens=False)
    matchers = [grammar.matcher() for _ in range(3)] + [None]
    for token in reply["input_ids"][:5]:
        grammar.accept(matchers[1], token)
    for token in reply["input_ids"]:
        grammar.accept(matchers[2], token)
    logits = torch.randn(4, len(tokenizer), generator=torch.Generator().manual_seed(0))
    ours = grammar.restrict(logits, matchers)
    bitmask = llguidance.torch.allocate_token_bitmask(4, len(tokenizer))
    for row, matcher in enumerate(matchers[:3]):
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, row)
    theirs = logits.clone()
    llguidance.torch.apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs)) and torch.equal(
        ours[~torch.isinf(ours)], logits[~torch.isinf(ours)]
    )
    assert not torch.isinf(ours[3]).any() and 0 < int((~torch.isinf(ours[1])).sum()) < len(tokenizer)


def test_the_cached_decoder_feeds_the_forced_tokens_with_the_chosen_ones(tokenizer, model):
    """Held to the grammar, the cached decoder's forward passes per reply are the tokens the model
    chose, not all it wrote: the runs the grammar forces ride along with the token before them."""
    passes = []
    hook = model.register_forward_hook(
        lambda module, args, kwargs, out: passes.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    try:
        [episode] = play_episodes(
            hf_generate_fn(model, tokenizer, "cached"),
            tokenizer,
            [(8, None, "hard")],
            sampling=Sampling(temperature=0.0, max_new_tokens=48, constrained=True),
            max_turns=1,
        )
    finally:
        hook.remove()
    decode_passes = len(passes) - 1  # the first pass reads the prompt
    written = len(episode.completion_ids)
    chosen = written - sum(action_grammar(tokenizer, len(tokenizer)).forced(episode.completion_ids))
    assert decode_passes < written - 1, (decode_passes, written)  # token by token: written - 1 passes
    assert decode_passes <= chosen, (decode_passes, chosen)
    assert any(shape[1] > 1 for shape in passes[1:]), "a pass fed a forced run"


def test_the_tokens_the_grammar_forced_are_told_from_the_chosen_ones(tokenizer):
    """In a reply written under the grammar, the opening and the keys the schema fixes had no
    alternative; the verb and the numbers were chosen."""
    from lib.episodes.grammar import train_chosen_tokens_only

    reply = '{"action_type":"configure_beam","parameters":{"beam_energy_tev":13.6,"pileup":"nominal"}}'
    ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    forced = action_grammar(tokenizer, len(tokenizer)).forced(ids)
    pieces = [tokenizer.decode([token]) for token in ids]
    assert forced[0] and not forced[pieces.index("configure_beam")]
    assert not any(f for f, piece in zip(forced, pieces) if any(c.isdigit() for c in piece)), "numbers are chosen"
    assert 0 < sum(forced) < len(ids)
    # env_mask runs: two replies with environment text between them; only the replies' chosen tokens stay
    env = tokenizer("observation", add_special_tokens=False)["input_ids"]
    mask = train_chosen_tokens_only(tokenizer, ids + env + ids, [1] * len(ids) + [0] * len(env) + [1] * len(ids))
    chosen = [int(not f) for f in forced]
    assert mask == chosen + [0] * len(env) + chosen
    # a reply the grammar refuses part-way counts as chosen from there on
    bad = tokenizer('{"x', add_special_tokens=False)["input_ids"]
    assert action_grammar(tokenizer, len(tokenizer)).forced(bad)[1:] == [False] * (len(bad) - 1)


def test_a_constrained_training_rollout_trains_only_the_chosen_tokens(tokenizer, tmp_path):
    """GRPO's samples from replies held to the grammar carry the forced tokens with env_mask 0."""
    from lib.episodes.grammar import train_chosen_tokens_only
    from lib.training import TrainConfig
    from lib.training.grpo import CampaignRollout, training_dataset

    config = TrainConfig(
        warm_start_episodes=0,
        max_steps=1,
        num_generations=2,
        gradient_accumulation_steps=2,
        max_turns=1,
        turn_samples=1,
        constrained_replies=True,
    )
    reply = tokenizer(
        '{"action_type":"configure_beam","parameters":{"beam_energy_tev":13.6}}', add_special_tokens=False
    )
    ids = reply["input_ids"] + [tokenizer.eos_token_id]

    def scripted(trainer):
        return lambda contexts, sampling, shown=None: [(list(ids), [-0.5] * len(ids)) for _ in contexts]

    rollout = CampaignRollout(config, tokenizer, generate_fn_factory=scripted)
    prompts = [row["prompt"] for row in training_dataset(config)] * 2
    out = rollout(prompts, trainer=None)
    assert out["completion_ids"] == [ids, ids]
    shown = rollout.last_episodes[0].shown  # what the first observation showed, under whose grammar it was written
    assert len(shown) == 1 and "luminosity.affordable_fb" not in shown[0]  # no beam yet: nothing to book
    assert out["env_mask"] == [train_chosen_tokens_only(tokenizer, ids, [1] * len(ids), shown)] * 2
    assert 0 < sum(out["env_mask"][0]) < len(ids)


def _writable(grammar, tokenizer, reply: str) -> bool:
    """Whether `reply`, then eos, is allowed token by token and ends the grammar."""
    matcher = grammar.matcher()
    ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return all(matcher.consume_token(token) for token in ids) and matcher.is_stopped()


def test_a_reply_quotes_only_the_references_its_observation_shows(tokenizer):
    """Under the grammar of an observation's references a reply may quote what it shows (a number
    scaled too) and nothing else: the replies the environment would refuse as referring to nothing
    shown, or as scaling a name, cannot be written; with nothing shown, no reference at all."""
    shown = {"luminosity.affordable_fb": 80.0, "fit.channel": "dimuon", "scan.candidates[0]": 120.0}
    grammar = action_grammar(tokenizer, len(tokenizer), shown)
    book = '{"action_type":"allocate_luminosity","parameters":{"luminosity_fb":"@luminosity.affordable_fb*0.4"}}'
    assert _writable(grammar, tokenizer, book)
    assert not _writable(grammar, tokenizer, book.replace("affordable", "booked"))  # not shown
    fit = '{"action_type":"fit_resonance","parameters":{"mass_hint_gev":"@scan.candidates[0]"}}'
    assert _writable(grammar, tokenizer, fit)
    assert not _writable(grammar, tokenizer, fit.replace("[0]", "[1]"))  # no second candidate shown
    assert not _writable(grammar, tokenizer, fit.replace("scan.candidates[0]", "fit.mass_gev"))  # no fit yet
    select = '{"action_type":"select_channel","parameters":{"channel":"@fit.channel"}}'
    assert _writable(grammar, tokenizer, select)
    assert not _writable(grammar, tokenizer, select.replace("@fit.channel", "@fit.channel*2"))  # a name
    nothing = action_grammar(tokenizer, len(tokenizer), {})
    assert not _writable(nothing, tokenizer, book)
    assert _writable(nothing, tokenizer, book.replace('"@luminosity.affordable_fb*0.4"', "32.0"))
    everything = action_grammar(tokenizer, len(tokenizer))  # without an observation: every known name
    assert _writable(everything, tokenizer, fit.replace("scan.candidates[0]", "fit.mass_gev"))


def test_a_reply_names_only_the_channels_and_triggers_its_task_offers(tokenizer):
    """Under the grammar of a `ReplyScope`, a channel or trigger written as text is one the task
    offers, in every verb that takes one (a claim may still name no channel), and a reference to a
    shown value is still writable; beam energies are left to the environment, written as the
    demonstrations write them. A plain mapping of references holds no option."""
    from cernenv.detector import CHANNELS, TRIGGERS

    env, checked = CERNCollisionEnvironment(), 0
    for seed in range(30, 36):
        obs = env.reset(seed=seed, difficulty=("easy", "medium", "hard")[seed % 3])
        offered = obs.task.offered_options()
        assert set(offered["channel"]) < set(CHANNELS)  # a task that offers fewer than all
        scope = ReplyScope({"fit.channel": offered["channel"][0]}, offered)
        grammar = action_grammar(tokenizer, len(tokenizer), scope)
        plain = action_grammar(tokenizer, len(tokenizer), {"fit.channel": offered["channel"][0]})
        for channel in CHANNELS:
            select = f'{{"action_type":"select_channel","parameters":{{"channel":"{channel}"}}}}'
            claim = (
                '{"action_type":"submit_discovery_claim","parameters":{"discovered":false,'
                f'"channel":"{channel}","significance_sigma":1.0,"confidence":0.5}}}}'
            )
            for reply in (select, claim):
                assert _writable(grammar, tokenizer, reply) == (channel in offered["channel"]), reply
                assert _writable(plain, tokenizer, reply), reply
                checked += 1
        for trigger in TRIGGERS:
            reply = f'{{"action_type":"set_trigger","parameters":{{"trigger":"{trigger}"}}}}'
            assert _writable(grammar, tokenizer, reply) == (trigger in offered["trigger"]), reply
        assert _writable(grammar, tokenizer, select.replace(f'"{channel}"', '"@fit.channel"'))
        assert _writable(grammar, tokenizer, claim.replace(f'"{channel}"', "null"))
        for energy in offered["beam_energy_tev"]:
            beam = json.dumps({"action_type": "configure_beam", "parameters": {"beam_energy_tev": energy}})
            assert _writable(grammar, tokenizer, beam.replace(" ", "")), beam
    assert checked == 6 * 2 * len(CHANNELS)


def test_a_parameter_quotes_only_the_shown_values_it_can_take(tokenizer):
    """Under the grammar of an observation's references a parameter may quote a shown value only of a
    type it takes: a channel names text, a mass a number, a spin an integer, unscaled; an enum
    parameter only a value of its own list; a flag nothing shown. The environment refuses the others
    ("Input should be a valid string"), so none can be written."""
    shown = {"fit.mass_gev": 500.0, "fit.channel": "dimuon", "angular.spin": 2}
    grammar = action_grammar(tokenizer, len(tokenizer), shown)
    select = '{"action_type":"select_channel","parameters":{"channel":"@fit.channel"}}'
    assert _writable(grammar, tokenizer, select)
    assert not _writable(grammar, tokenizer, select.replace("fit.channel", "fit.mass_gev"))
    fit = '{"action_type":"fit_resonance","parameters":{"mass_hint_gev":"@fit.mass_gev*1.01"}}'
    assert _writable(grammar, tokenizer, fit) and _writable(grammar, tokenizer, fit.replace("*1.01", ""))
    assert _writable(grammar, tokenizer, fit.replace("fit.mass_gev*1.01", "angular.spin"))  # an integer is a number
    assert not _writable(grammar, tokenizer, fit.replace("fit.mass_gev*1.01", "fit.channel"))
    assert not _writable(
        grammar, tokenizer, fit.replace('"@fit.mass_gev*1.01"}', '500.0,"float_width":"@fit.channel"}')
    )
    claim = (
        '{"action_type":"submit_discovery_claim","parameters":{"discovered":true,"mass_gev":"@fit.mass_gev",'
        '"mass_uncertainty_gev":2.0,"channel":"@fit.channel","spin":"@angular.spin","significance_sigma":5.1,'
        '"confidence":0.9}}'
    )
    assert _writable(grammar, tokenizer, claim)
    assert not _writable(grammar, tokenizer, claim.replace('"@angular.spin"', '"@angular.spin*1"'))
    assert not _writable(grammar, tokenizer, claim.replace('"@angular.spin"', '"@fit.mass_gev"'))
    assert not _writable(grammar, tokenizer, claim.replace('"channel":"@fit.channel"', '"channel":"@angular.spin"'))
    beam = '{"action_type":"configure_beam","parameters":{"beam_energy_tev":13.6,"pileup":"@fit.channel"}}'
    assert not _writable(grammar, tokenizer, beam)  # "dimuon" is no pileup setting
    assert _writable(grammar, tokenizer, beam.replace('"@fit.channel"', '"low"'))


def test_a_name_the_observation_alone_shows_is_forced_and_not_trained(tokenizer):
    """Where the observation shows one reference, the grammar of that observation forces its name
    once the reply opens a reference: those tokens were not the policy's choice, and
    `train_chosen_tokens_only` given what each reply's observation showed leaves them out, where the
    grammar of every name counts them as chosen."""
    from lib.episodes.grammar import train_chosen_tokens_only

    reply = '{"action_type":"fit_resonance","parameters":{"mass_hint_gev":"@scan.best_mass_gev"}}'
    ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    shown = {"scan.best_mass_gev": 515.2}
    narrow = action_grammar(tokenizer, len(tokenizer), shown).forced(ids)
    wide = action_grammar(tokenizer, len(tokenizer)).forced(ids)
    assert sum(narrow) > sum(wide) and all(n or not w for n, w in zip(narrow, wide))
    mask = train_chosen_tokens_only(tokenizer, ids, [1] * len(ids), [shown])
    assert mask == [int(not f) for f in narrow]
    assert train_chosen_tokens_only(tokenizer, ids, [1] * len(ids)) == [int(not f) for f in wide]


def test_a_rollout_scored_within_the_grammar_hands_the_trainer_what_it_admitted(tokenizer):
    """With `renormalise_to_grammar`, each of the step's samples is found in the trainer's
    `AdmittedTokens` by its tokens, with the grammar's rows of the observation it answered; the
    next step's rollout replaces them."""
    from trl import GRPOTrainer

    from lib.episodes.grammar import reply_admitted
    from lib.training import TrainConfig
    from lib.training.grpo import CampaignRollout, training_dataset
    from lib.training.trainer_class import padding_trimmed_trainer

    config = TrainConfig(
        warm_start_episodes=0,
        max_steps=2,
        num_generations=2,
        gradient_accumulation_steps=2,
        max_turns=1,
        turn_samples=1,
        renormalise_to_grammar=True,
    )
    ids = tokenizer('{"action_type":"configure_beam","parameters":{"beam_energy_tev":13.6}}', add_special_tokens=False)[
        "input_ids"
    ] + [tokenizer.eos_token_id]
    rollout = CampaignRollout(
        config,
        tokenizer,
        generate_fn_factory=lambda trainer: (
            lambda contexts, sampling, shown=None: [(list(ids), [-0.5] * len(ids)) for _ in contexts]
        ),
    )
    trainer_class = padding_trimmed_trainer(GRPOTrainer)
    trainer = trainer_class.__new__(trainer_class)  # the rollout reads nothing else of it
    dataset = training_dataset(config)
    out = rollout([dataset[0]["prompt"]] * 2, trainer=trainer)
    shown = rollout.last_episodes[0].shown
    expected = reply_admitted(tokenizer, ids, [1] * len(ids), shown)
    assert len(trainer.admitted_tokens) == 2
    for prompt in out["prompt_ids"]:
        assert np.array_equal(trainer.admitted_tokens.rows(prompt, ids), expected)
    rollout([dataset[1]["prompt"]] * 2, trainer=trainer)
    assert len(trainer.admitted_tokens) == 2 and trainer.admitted_tokens.rows(out["prompt_ids"][0], ids) is None
