"""The GPU training path, as far as a CPU can check it: the generation engine, the order
Unsloth must be imported in, and the precision chosen for the device.

What needs a GPU (Unsloth's kernels and inference mode, bf16/fp16 training, the
measurements of `bench/bench_train.py` there) is not run here: see docs/gpu.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from lib.agents.prompting import Sampling
from lib.episodes.generation import BatchedGenerate, CachedGenerator, hf_generate_fn
from lib.episodes.llm_rollouts import play_episodes
from lib.training import TrainConfig, backends
from lib.training.run import task_key

ROOT = Path(__file__).resolve().parents[1]
SPECS = [(21, None, "easy"), (22, "higgs_4l_125", None), (23, None, "hard")]


@pytest.mark.parametrize("constrained", [False, True])
@pytest.mark.parametrize("context", ["conversation", "turn"])
def test_generate_engine_plays_what_the_cached_decoder_plays(tokenizer, model, context, constrained):
    """Greedy, three episodes of different context lengths (left padding): the same tokens and
    log-probabilities from the model's own `generate` as from the hand-written decoder, whether a
    turn's context is read afresh (the `turn` context) or continues a cached conversation. Held to
    the grammar, `generate` feeds one token per pass where the cached decoder feeds each chosen
    token with the run the grammar forces after it (padded runs, the padding cut from the caches
    the next turns continue)."""
    greedy = Sampling(temperature=0.0, max_new_tokens=48 if constrained else 12, constrained=constrained)
    kwargs = dict(sampling=greedy, max_turns=3, context=context)
    engine = play_episodes(hf_generate_fn(model, tokenizer, "generate"), tokenizer, SPECS, **kwargs)
    cached = play_episodes(hf_generate_fn(model, tokenizer, "cached"), tokenizer, SPECS, **kwargs)
    for a, b in zip(engine, cached):
        assert a.completion_ids == b.completion_ids and a.env_mask == b.env_mask
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_generate_engine_logprobs_are_what_the_trainer_scores(tokenizer, model):
    """At the training temperature TRL scores log_softmax(logits / T) of the whole sequence:
    the engine's sampling log-probabilities must be those numbers."""
    temperature = 0.6
    [episode] = play_episodes(
        hf_generate_fn(model, tokenizer, "generate"),
        tokenizer,
        [(8, None, "hard")],
        sampling=Sampling(temperature=temperature, max_new_tokens=10),
        max_turns=1,
        seed=5,
    )
    ids = torch.tensor([episode.prompt_ids + episode.completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(episode.prompt_ids) - 1 : -1].float() / temperature
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(episode.completion_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(episode.logprobs), expected, atol=1e-4)


def test_generate_engine_ignores_the_models_generation_defaults(tokenizer, model):
    """A checkpoint's generation_config (Qwen's sets top_k, top_p, a repetition penalty) must not
    change how actions are sampled: the sampling GRPO assumes is `Sampling`'s alone."""
    sampling = Sampling(temperature=1.0, max_new_tokens=10)
    plain = play_episodes(
        hf_generate_fn(model, tokenizer, "generate"), tokenizer, SPECS[:2], sampling=sampling, max_turns=1, seed=11
    )
    saved = model.generation_config
    model.generation_config = type(saved)(top_k=1, top_p=0.1, repetition_penalty=5.0, do_sample=False)
    try:
        patched = play_episodes(
            hf_generate_fn(model, tokenizer, "generate"), tokenizer, SPECS[:2], sampling=sampling, max_turns=1, seed=11
        )
    finally:
        model.generation_config = saved
    assert [e.completion_ids for e in plain] == [e.completion_ids for e in patched]


def test_compiled_engine_generates_what_generate_does_through_reused_static_caches(tokenizer, model):
    """The compiled engine (a static KV cache, the decoding step through torch.compile; its "eager"
    backend here, which traces the same graph without a C compiler): the same tokens and
    log-probabilities as `generate`, the batch padded to a bucket and the padding rows dropped, one
    cache per batch size reused between calls, and a longer context making the caches longer."""
    from lib.episodes.generation import CACHE_BUCKET_TOKENS

    contexts = [tokenizer.encode(text) for text in ("configure the beam", "a longer context: " * 12, "spin")]
    greedy = Sampling(temperature=0.0, max_new_tokens=6)
    expected = BatchedGenerate(model, tokenizer)(contexts, greedy)
    compiled = BatchedGenerate(model, tokenizer, compiled=True, compile_backend="eager")
    got = compiled(contexts, greedy)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, a), (_, b) in zip(got, expected):
        assert a == pytest.approx(b, abs=1e-4)
    (cache,) = compiled._caches.values()
    assert list(compiled._caches) == [4] and compiled._cache_tokens == CACHE_BUCKET_TOKENS  # 3 rows -> 4
    assert [tokens for tokens, _ in compiled(contexts[::-1][:3], greedy)] == [t for t, _ in expected[::-1]]
    assert compiled._caches[4] is cache, "the same batch size reuses its cache"
    long_context = [contexts[1] * 40]
    assert len(long_context[0]) > CACHE_BUCKET_TOKENS
    ((reply, _),) = compiled(long_context, greedy)
    assert reply == BatchedGenerate(model, tokenizer)(long_context, greedy)[0][0]
    needed = len(long_context[0]) + greedy.max_new_tokens
    assert compiled._cache_tokens == -(-needed // CACHE_BUCKET_TOKENS) * CACHE_BUCKET_TOKENS
    assert list(compiled._caches) == [1], "a longer cache: the shorter ones are dropped"


@pytest.mark.parametrize("largest_single_threaded, threads_seen", [(10_000_000, 1), (0, 2)])
def test_the_cached_decoder_runs_a_small_model_on_one_thread_and_a_larger_one_on_the_callers(
    monkeypatch, tokenizer, model, largest_single_threaded, threads_seen
):
    """The stand-in's forwards run on one thread; a model above the bound keeps torch's threads as
    its caller set them, and either way the caller's setting is back after the call."""
    from lib.episodes import generation

    monkeypatch.setattr(generation, "SINGLE_THREAD_MAX_PARAMETERS", largest_single_threaded)
    seen = []
    forward = model.forward

    def counting_forward(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", counting_forward)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        generate = hf_generate_fn(model, tokenizer, "cached")
        generate([tokenizer.encode("configure_beam")], Sampling(temperature=0.0, max_new_tokens=3))
        assert seen and set(seen) == {threads_seen}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_engine_choice(tokenizer, model):
    assert isinstance(hf_generate_fn(model, tokenizer), CachedGenerator)  # auto on a CPU
    assert isinstance(hf_generate_fn(model, tokenizer, "generate"), BatchedGenerate)
    assert hf_generate_fn(model, tokenizer, "compiled").compiled
    with pytest.raises(ValueError, match="engine must be one of"):
        hf_generate_fn(model, tokenizer, "hand-written")
    with pytest.raises(ValueError, match="Unsloth"):
        hf_generate_fn(model, tokenizer, "cached", unsloth=True)
    with pytest.raises(ValueError, match="generation_engine"):
        TrainConfig(generation_engine="fast")


def test_four_bit_weights_are_asked_for_with_lora_and_said_to_need_a_gpu(monkeypatch, tiny_model_dir):
    with pytest.raises(ValueError, match="load_in_4bit trains LoRA adapters over 4-bit weights: set lora_r > 0"):
        TrainConfig(load_in_4bit=True)
    config = TrainConfig(load_in_4bit=True, lora_r=16, beta=0.0, model_name=str(tiny_model_dir), backend="trl")
    with pytest.raises(ValueError, match="load_in_4bit needs a CUDA GPU"):
        backends.load_policy(config)
    assert backends.four_bit_loading(TrainConfig()) == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    loading = backends.four_bit_loading(config)
    quantization = loading["quantization_config"]
    assert quantization.load_in_4bit and quantization.bnb_4bit_quant_type == "nf4"
    assert quantization.bnb_4bit_compute_dtype == torch.bfloat16 and loading["device_map"] == {"": 0}


@pytest.mark.parametrize(
    "bf16_supported, dtype, flags",
    [
        (True, torch.bfloat16, {"bf16": True, "fp16": False}),
        (False, torch.float16, {"bf16": False, "fp16": True}),  # a T4: Unsloth loads fp16, so must the trainer
    ],
)
def test_precision_follows_the_device(monkeypatch, bf16_supported, dtype, flags):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16_supported)
    assert backends.policy_dtype() == dtype
    assert backends.precision_flags() == flags


def test_precision_on_a_cpu():
    assert backends.policy_dtype() == torch.float32
    assert backends.precision_flags() == {"bf16": False, "fp16": False}


FAKE_UNSLOTH = textwrap.dedent('''
    """A stand-in for unsloth: records what was imported before it, then refuses to load a model."""
    import sys

    IMPORTED_BEFORE = sorted(name for name in ("transformers", "peft", "trl") if name in sys.modules)


    class FastLanguageModel:
        @staticmethod
        def from_pretrained(**kwargs):
            raise RuntimeError("fake unsloth: dtype=" + str(kwargs.get("dtype")))
''')


def _run_with_fake_cuda(tmp_path, code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter that reports a CUDA device (without bf16) and has
    the fake unsloth package above on its path."""
    (tmp_path / "unsloth").mkdir()
    (tmp_path / "unsloth" / "__init__.py").write_text(FAKE_UNSLOTH)
    prelude = (
        "import torch\ntorch.cuda.is_available = lambda: True\ntorch.cuda.is_bf16_supported = lambda *a, **k: False\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}  # the fake unsloth
    return subprocess.run(
        [sys.executable, "-c", prelude + code], capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300
    )


@pytest.mark.slow
def test_train_imports_unsloth_before_transformers_peft_and_trl(tmp_path):
    code = textwrap.dedent(f"""
        import json, sys
        from lib.training import TrainConfig, train
        assert "transformers" not in sys.modules
        config = TrainConfig(backend="auto", evidence_dir={str(tmp_path / "evidence")!r},
                             output_dir={str(tmp_path / "out")!r})
        try:
            train(config)
        except RuntimeError as error:
            message = str(error)
        import unsloth
        print(json.dumps({{"imported_before": unsloth.IMPORTED_BEFORE, "message": message}}))
    """)
    result = _run_with_fake_cuda(tmp_path, code)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["imported_before"] == []
    assert report["message"] == "fake unsloth: dtype=torch.float16"  # the device's dtype reached Unsloth


def test_backend_trl_never_imports_unsloth(tmp_path):
    """Once imported, Unsloth replaces TRL's trainer for the whole process: a trl run must not
    import it, not even to see whether it is there."""
    code = textwrap.dedent("""
        import sys
        from lib.training import TrainConfig
        from lib.training.backends import import_unsloth_first, resolve_backend, unsloth_available
        assert unsloth_available() == (True, "")
        assert resolve_backend(TrainConfig(backend="trl")) == "trl"
        assert import_unsloth_first(TrainConfig(backend="trl")) is False
        print("unsloth" in sys.modules)
    """)
    result = _run_with_fake_cuda(tmp_path, code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "False"


def _fake_unsloth(calls: list):
    """A stand-in for unsloth's FastLanguageModel that loads as Unsloth does where it matters here:
    the tokenizer with AutoTokenizer (unsloth/tokenizer_utils.py), and records its arguments."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    class FastLanguageModel:
        @staticmethod
        def from_pretrained(**kwargs):
            calls.append(("from_pretrained", kwargs))
            name = kwargs["model_name"]
            return AutoModelForCausalLM.from_pretrained(name), AutoTokenizer.from_pretrained(name)

        @staticmethod
        def get_peft_model(model, **kwargs):
            calls.append(("get_peft_model", kwargs))
            return model

    return types.SimpleNamespace(FastLanguageModel=FastLanguageModel)


@pytest.mark.parametrize("lora_r", [16, 0])
def test_unsloth_loads_a_saved_policy_offline_with_the_tokenizer_it_was_trained_with(
    monkeypatch, tiny_model_dir, lora_r
):
    """A saved policy folder with the project tokenizer (the stand-in; the GPU benchmark's
    Qwen-shaped model): Unsloth's AutoTokenizer splits its text otherwise, so the backend reads
    the folder's own; the folder loads without asking the Hub; lora_r=0 is full fine-tuning."""
    from transformers import AutoTokenizer

    from lib.training.tokenizer import load_tokenizer

    calls: list = []
    monkeypatch.setitem(sys.modules, "unsloth", _fake_unsloth(calls))
    policy = backends._load_unsloth(TrainConfig(lora_r=lora_r, beta=0.0), tiny_model_dir)
    text = "estimate_significance at mass_gev 125.3 with 139.0 fb^-1"
    trained_with = load_tokenizer(tiny_model_dir)(text)["input_ids"]
    assert AutoTokenizer.from_pretrained(tiny_model_dir)(text)["input_ids"] != trained_with  # the hazard is real
    assert policy.tokenizer(text)["input_ids"] == trained_with
    (_, loaded), *peft = calls
    assert loaded["local_files_only"] is True and loaded["full_finetuning"] is (lora_r == 0)
    assert [call[1]["r"] for call in peft] == ([lora_r] if lora_r else [])


def test_both_backends_train_with_the_same_optimiser(monkeypatch, tmp_path, tiny_model_dir):
    """Unsloth's patched TRL configs default to 8-bit AdamW with weight decay 0.001
    (unsloth/models/rl.py): the GRPO and warm-start trainers name their optimiser, so a
    config class with those defaults changes nothing."""
    import dataclasses

    import trl

    from lib.training.run import grpo_args
    from lib.training.warm_start import sft_trainer

    for name in ("GRPOConfig", "SFTConfig"):
        base = getattr(trl, name)
        fields = [("optim", str, dataclasses.field(default="adamw_8bit")), ("weight_decay", float, 0.001)]
        monkeypatch.setattr(trl, name, dataclasses.make_dataclass(f"Unsloth{name}", fields, bases=(base,)))
    assert trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False).optim == "adamw_8bit"  # its default
    args = grpo_args(TrainConfig(output_dir=str(tmp_path)))
    assert (args.optim, args.weight_decay) == ("adamw_torch_fused", 0.0)
    built = []
    monkeypatch.setattr(trl, "SFTTrainer", lambda **kwargs: built.append(kwargs["args"]))
    policy = backends.load_policy(TrainConfig(model_name=tiny_model_dir, backend="trl"))
    sft_trainer(policy, TrainConfig(), [{"input_ids": [1, 2], "completion_mask": [0, 1]}], str(tmp_path / "sft"))
    assert (built[0].optim, built[0].weight_decay) == ("adamw_torch_fused", 0.0)


def test_the_vllm_engine_is_called_as_trl_s_vllm_generation_is_defined(tokenizer):
    """`use_vllm=True` (unmeasured: vLLM cannot reach the GPU machine): the rollout calls TRL's
    `VLLMGeneration.generate` with arguments its signature takes, one completion per context,
    and keeps each reply up to its eos with the sampled token's log-probability."""
    import inspect

    from trl.generation.vllm_generation import VLLMGeneration

    from lib.training.grpo import vllm_generate_fn

    signature, eos = inspect.signature(VLLMGeneration.generate), tokenizer.eos_token_id

    class Engine:
        def generate(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs).arguments
            assert bound["num_generations"] == 1 and bound["images"] is None
            prompts = bound["prompts"]
            completions = [[7, 8, eos, 9], [5, 6]]  # vLLM may run past an eos in its token list; or not reach one
            logprobs = [[[-0.5], [-0.25], [-0.125], [-2.0]], [[-1.0], [None]]]
            return prompts, completions[: len(prompts)], logprobs[: len(prompts)], None

    trainer = types.SimpleNamespace(vllm_generation=Engine(), processing_class=tokenizer)
    replies = vllm_generate_fn(trainer)([[1, 2, 3], [4]], Sampling())
    assert replies == [([7, 8, eos], [-0.5, -0.25, -0.125]), ([5, 6], [-1.0, 0.0])]


def test_records_and_specs_name_the_same_task():
    """The step-0 checkpoint row reuses the pre-training evaluation only if its records are
    recognised as the checkpoint specs (a record says "procedural_hard" where a spec says None)."""
    assert task_key(5, "procedural_hard", "hard") == task_key(5, None, "hard")
    assert task_key(6, "higgs_4l_125", "medium") == task_key(6, "higgs_4l_125", None)
    assert task_key(5, None, "hard") != task_key(5, None, "easy")


def _bench_train_gpu():
    from bench import bench_train_gpu

    return bench_train_gpu


def test_the_gpu_benchmark_model_has_qwen2_5_1_5b_s_shape(tokenizer):
    """1.31B parameters outside the embedding, as Qwen2.5-1.5B's model card states (built on the
    meta device: no memory)."""
    from transformers import Qwen2ForCausalLM

    bench = _bench_train_gpu()
    with torch.device("meta"):
        model = Qwen2ForCausalLM(bench.model_config(tokenizer, bench.QWEN25_15B_SHAPE))
    non_embedding = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    assert round(non_embedding / 1e9, 2) == 1.31


def test_the_gpu_benchmark_refuses_a_cpu_and_checks_its_targets():
    bench = _bench_train_gpu()
    if not torch.cuda.is_available():
        assert bench.main(["--backends", "trl"]) == 2
    fast = {
        "mean": {"total_s": 12.0, "generated_tokens": 5120.0, "generation_tokens_per_s": 6000.0},
        "share": {"generation_s": 0.5, "environment_s": 0.01},
    }
    report = bench.summary(
        {"unsloth": {**fast, "peak_gpu_memory_gib": 5.0}, "trl": {**fast, "peak_gpu_memory_gib": 9.0}}
    )
    assert report["targets"]["unsloth peak memory <= 0.6 x trl's"] is True
    assert all(report["targets"].values()) and len(report["targets"]) == 5
    slow = bench.summary({"trl": {**fast, "mean": {**fast["mean"], "total_s": 36.9}, "peak_gpu_memory_gib": 9.0}})
    assert slow["targets"]["trl: step <= 15 s"] is False


@pytest.mark.slow
def test_the_gpu_benchmark_runs_on_a_cpu_with_a_tiny_shape(tmp_path):
    """The script a GPU session runs (bench/bench_train_gpu.py), checked end to end here. Its GRPO
    steps are made small by the TrainConfig flags it passes on after its own (the last one given
    wins): one group of 2 episodes a step instead of 16 episodes. What is checked (a step timed,
    tokens generated, the report and the profile written) does not depend on the size, and torch's
    profiler took ~10 s to tabulate the events of a 16-episode step."""
    out = tmp_path / "result.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_train_gpu.py"),
            "--shape",
            "tiny",
            "--allow-cpu",
            "--parts",
            "generation",
            "backends",
            "--engines",
            "generate",
            "--batch-sizes",
            "2",
            "--backends",
            "trl",
            "--steps",
            "1",
            "--max_turns",
            "1",
            "--max_new_tokens",
            "8",
            "--num_generations",
            "2",
            "--per_device_train_batch_size",
            "2",
            "--gradient_accumulation_steps",
            "1",
            "--profile-dir",
            str(tmp_path),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"},
    )
    assert done.returncode in (0, 1), done.stderr[-3000:]
    report = json.loads(out.read_text())
    row = report["backends"]["trl"]
    assert row["seconds_per_step"] > 0 and 0 < row["generation_share"] < 1
    assert row["generated_tokens_per_step"] > 0 and report["device"] == "cpu"
    assert report["versions"]["trl"] and report["versions"]["torch"]
    profile = (tmp_path / "profile_trl.txt").read_text()
    assert profile.startswith("profiled step 2:") and "aten::" in profile
    (generated,) = report["generation"]["rows"]  # the generation table, row by row in generation.jsonl too
    assert generated["engine"] == "generate" and generated["batch"] == 2 and generated["tokens"] == 2 * 8
    assert generated["logprob_max_abs_diff"] < 1e-4 and generated["generate_calls"] == 1
    assert [json.loads(line) for line in (tmp_path / "generation.jsonl").read_text().splitlines()] == [generated]


def test_the_gpu_session_skips_what_its_budget_cannot_hold_and_reads_its_targets(tmp_path):
    bench = _bench_train_gpu()
    out = tmp_path / "result.json"
    code = bench.main(["--shape", "tiny", "--allow-cpu", "--parts", "generation", "colab-step", "--budget", "1"])
    assert code == 1  # nothing measured, no target met
    code = bench.main(["--shape", "tiny", "--allow-cpu", "--parts", "colab-step", "--budget", "1", "--out", str(out)])
    assert json.loads(out.read_text())["colab_step"]["skipped"].endswith("of the budget left")
    rows = [
        {"engine": "compiled", "batch": 16, "tokens_per_s": 6100.0},
        {"engine": "generate", "batch": 16, "tokens_per_s": 390.0, "load_in_4bit": True},
        {"engine": "compiled", "batch": 64, "tokens_per_s": 9000.0},
    ]
    assert bench.generation_targets(rows) == {
        "compiled: generation at batch 16 >= 5000 tokens/s": True,
        "generate 4-bit: generation at batch 16 >= 5000 tokens/s": False,
    }
    assert bench.four_bit_targets({"peak_gpu_memory_gib": 2.9}, {"peak_gpu_memory_gib": 5.15}) == {
        "4-bit peak memory <= 0.6 x 16-bit TRL's": True
    }
    assert bench.four_bit_targets({"error": "exit 1"}, {"peak_gpu_memory_gib": 5.15}) == {}


def test_the_gpu_benchmark_keeps_a_result_printed_before_a_backend_stopped():
    """A backend stopped while it writes its profile has printed its figures: they are read back."""
    bench = _bench_train_gpu()
    result = {"backend": "trl", "mean": {"total_s": 20.3}}
    printed = "step 0 took 36.95 s\n" + json.dumps(result) + "\nprofile of step 3 written to p.txt\n"
    assert bench.result_line(printed) == result
    assert bench.result_line("step 0 took 36.95 s\n{not json\n") is None
    assert bench.result_line('{"steps": []}\n') is None
