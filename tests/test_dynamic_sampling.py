"""DAPO's dynamic sampling (``egpo_trl.sampling.dynamic``) in real runs on TRL's machinery and a tiny Qwen2.

The batch fills with informative groups, rows keep their rewards when they move, an extra round generates only
the shortfall, the cap stops a run without informative groups with a warning, and two processes keep the same
groups and run the same rounds.
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import make_prompt_dataset, parity_reward
from conftest import trainer_config as config
from recording import Recording, answers_of, history, rows, texts


def half_informative_reward(completions, answer, **kwargs):
    """Uninformative (-1 throughout) on prompts with an even answer; the parity reward on the others."""
    parity = parity_reward(completions)
    return [-1.0 if int(a) % 2 == 0 else p for a, p in zip(answer, parity)]


def always_wrong(completions, **kwargs):
    return [-1.0] * len(completions)


def mostly_informative_reward(completions, answer, **kwargs):
    """Uninformative (-1 throughout) on 2 of make_prompt_dataset's 8 prompts (answers 10 and 22); parity otherwise."""
    parity = parity_reward(completions)
    return [-1.0 if (int(a) - 10) % 12 == 0 else p for a, p in zip(answer, parity)]


class RoundRecording(Recording):
    """Also keeps the prompts each generation round was given (one list of rows per call)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.round_inputs = []

    def _generate_round(self, inputs):
        self.round_inputs.append([str(row["prompt"]) for row in inputs])
        return super()._generate_round(inputs)


@pytest.mark.slow
def test_dynamic_sampling_fills_the_batch_with_informative_groups(tmp_path, tiny_model_dir):
    args = config(tmp_path, max_steps=4, dynamic_sampling=True, dynamic_sampling_max_rounds=8)
    trainer = Recording(tiny_model_dir, half_informative_reward, args, train_dataset=make_prompt_dataset())
    trainer.train()

    rounds = history(trainer, "dynamic_sampling/rounds")
    assert len(rounds) == 4 and sum(rounds) > 4, "half the prompts are uninformative: some steps need extra rounds"
    assert history(trainer, "dynamic_sampling/cap_hit") == [0.0] * 4
    for generated in trainer.generated:
        batch = generated["batch"]
        sampling = batch["dynamic_sampling"]
        assert not sampling["cap_hit"] and len(sampling["selected"]) == sampling["target_groups"] == 2
        correctness = batch["rewards_per_func"][:, 0].view(-1, 4) > 0
        assert (correctness.any(dim=1) & ~correctness.all(dim=1)).all(), "every kept group is mixed"
        # Each kept row still carries its own reward: recompute it from the row's prompt and completion text.
        prompts, completions = texts(trainer, generated)
        recomputed = half_informative_reward(completions, answers_of(trainer, prompts))
        torch.testing.assert_close(batch["rewards_per_func"][:, 0], torch.tensor(recomputed))
        # The completions table shows the kept rows, with the advantages the loss uses.
        assert list(trainer._logs["prompt"])[-8:] is not None
        assert generated["advantages"].abs().sum() > 0
    logged_rewards = list(trainer._logs["rewards"]["half_informative_reward"])
    assert logged_rewards == trainer.generated[-1]["batch"]["rewards_per_func"][:, 0].tolist()
    assert list(trainer._logs["advantages"]) == trainer.generated[-1]["batch"]["result"].advantages.tolist()

    # The loss consumed exactly the assembled rows.
    kept = {row for g in trainer.generated for row in rows(g["completion_ids"], g["completion_mask"])}
    for consumed in trainer.consumed:
        assert set(rows(consumed["completion_ids"], consumed["completion_mask"])) <= kept


@pytest.mark.slow
def test_dynamic_sampling_cap_stops_a_run_without_informative_groups(tmp_path, tiny_model_dir, caplog):
    args = config(tmp_path, max_steps=2, dynamic_sampling=True, dynamic_sampling_max_rounds=3)
    trainer = Recording(tiny_model_dir, always_wrong, args, train_dataset=make_prompt_dataset())
    with caplog.at_level(logging.WARNING, logger="egpo_trl.sampling.dynamic"):
        trainer.train()
    assert trainer.state.global_step == 2
    assert history(trainer, "dynamic_sampling/rounds") == [3.0, 3.0]
    assert history(trainer, "dynamic_sampling/cap_hit") == [1.0, 1.0]
    assert history(trainer, "dynamic_sampling/frac_informative") == [0.0, 0.0]
    warnings = [r.getMessage() for r in caplog.records if "Dynamic sampling" in r.getMessage()]
    assert len(warnings) == 2
    assert "0 of the 2 groups" in warnings[0] and "dynamic_sampling_max_rounds=3" in warnings[0]
    # The batch keeps its shape: the first round's groups fill it.
    sampling = trainer.generated[0]["batch"]["dynamic_sampling"]
    assert sampling["selected"] == [(0, 0), (0, 1)] and trainer.generated[0]["completion_ids"].size(0) == 8


@pytest.mark.slow
@pytest.mark.parametrize("oversample", [1.0, 1.5])
def test_dynamic_sampling_with_two_processes_keeps_the_same_groups_everywhere(tmp_path, tiny_model_dir, oversample):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoTokenizer

    script = Path(__file__).parent / "scripts" / "ddp_dynamic_sampling.py"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    port = 30500 + os.getpid() % 1000 + (7 if oversample > 1 else 0)
    command += ["--master_port", str(port), str(script), tiny_model_dir, str(tmp_path), str(oversample)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    ranks = [torch.load(tmp_path / f"records_rank{r}.pt") for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    lookup = {}
    for row in make_prompt_dataset():
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        lookup[tokenizer.decode(ids, skip_special_tokens=True)] = row["answer"]

    smaller = added_kept = 0
    extra = 2 if oversample > 1 else 0  # ceil(0.5 x 4) groups, one per process
    for first, second in zip(ranks[0]["records"], ranks[1]["records"]):
        # Both processes took the same decisions from the same gathered rewards ...
        assert first["selected"] == second["selected"] and first["rounds"] == second["rounds"]
        torch.testing.assert_close(first["rewards_per_func"], second["rewards_per_func"])
        assert all(torch.equal(a, b) for a, b in zip(first["informative"], second["informative"]))
        # ... ran the same generation rounds with the same number of rows, an extra round generating only the
        # shortfall (its groups split over both processes) ...
        assert first["round_groups"] == second["round_groups"] and first["round_groups"][0] == 4 + extra
        assert first["first_round_extra_groups"] == second["first_round_extra_groups"] == extra
        assert first["round_rows"] == second["round_rows"] == [groups * 2 for groups in first["round_groups"]]
        smaller += sum(groups < 4 for groups in first["round_groups"][1:])
        # In an oversampled first round each process's rows are its 2 groups of the batch, then its added group:
        # gathered, groups 2 and 5 are the added ones, and they are kept only after the batch's own.
        if extra:
            kept_first_round = [g for r, g in first["selected"] if r == 0]
            own = [g for g in kept_first_round if g not in (2, 5)]
            assert kept_first_round[: len(own)] == own
            added_kept += len(kept_first_round) - len(own)
        # The completions table holds the kept batch's rows on every process (TRL's deques survive the longer round).
        assert first["table_rows"] == second["table_rows"] == 16
        assert first["table_rewards"] == second["table_rewards"] == first["rewards_per_func"][:, 0].tolist()
        # ... kept 4 informative groups of 4, 8 rows on each process ...
        assert not first["cap_hit"] and first["completion_ids"].size(0) == second["completion_ids"].size(0) == 8
        correct = first["rewards_per_func"][:, 0].view(-1, 4) > 0
        assert (correct.any(dim=1) & ~correct.all(dim=1)).all()
        torch.testing.assert_close(
            torch.cat([first["local_advantages"], second["local_advantages"]]), first["global_advantages"]
        )
        # ... and every row that moved between processes still matches its reward.
        for rank, record in enumerate((first, second)):
            prompts = tokenizer.batch_decode(record["prompt_ids"], skip_special_tokens=True)
            ids = [r[m.bool()] for r, m in zip(record["completion_ids"], record["completion_mask"])]
            completions = tokenizer.batch_decode(ids, skip_special_tokens=True)
            expected = mostly_informative_reward(completions, [lookup[p] for p in prompts])
            torch.testing.assert_close(record["rewards_per_func"][8 * rank : 8 * rank + 8, 0], torch.tensor(expected))
    if extra:
        assert added_kept > 0, "some added group replaces an uninformative one"
    else:
        assert smaller > 0, "some step needs an extra round, smaller than a generation batch"


@pytest.mark.slow
def test_dynamic_sampling_metrics_describe_the_kept_batch(tmp_path, tiny_model_dir):
    args = config(tmp_path, max_steps=3, dynamic_sampling=True, dynamic_sampling_max_rounds=8)
    trainer = Recording(tiny_model_dir, half_informative_reward, args, train_dataset=make_prompt_dataset())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == len(trainer.generated) == 3
    assert sum(history(trainer, "dynamic_sampling/rounds")) > 3, "some steps need extra rounds"
    for log, generated in zip(logs, trainer.generated):
        rewards = generated["batch"]["rewards_per_func"][:, 0]
        lengths = generated["completion_mask"].sum(dim=1).float()
        # Every kept group is mixed: no zero-std group, whatever the discarded rounds held.
        assert log["frac_reward_zero_std"] == 0.0
        assert log["reward"] == pytest.approx(rewards.mean().item(), abs=1e-6)
        assert log["reward_std"] == pytest.approx(rewards.std().item(), abs=1e-6)
        assert log["rewards/half_informative_reward/mean"] == pytest.approx(rewards.mean().item(), abs=1e-6)
        assert log["completions/mean_length"] == pytest.approx(lengths.mean().item(), abs=1e-6)
        assert log["completions/max_length"] == lengths.max().item()


@pytest.mark.slow
def test_an_extra_round_generates_only_the_shortfall(tmp_path, tiny_model_dir):
    from fractions import Fraction
    from math import ceil

    from egpo_trl.sampling.dynamic import MIN_INFORMATIVE_FRACTION

    # 16 rows of 4 completions: generation batches of 4 groups, of which 1 or 2 are usually uninformative.
    settings = dict(max_steps=4, per_device_train_batch_size=16, dynamic_sampling=True, dynamic_sampling_max_rounds=8)
    trainer = RoundRecording(
        tiny_model_dir, mostly_informative_reward, config(tmp_path, **settings), train_dataset=make_prompt_dataset()
    )
    trainer.train()

    calls = iter(trainer.round_inputs)
    smaller = 0
    for generated, per_kept in zip(trainer.generated, history(trainer, "dynamic_sampling/generated_per_kept")):
        batch = generated["batch"]
        sampling = batch["dynamic_sampling"]
        target = sampling["target_groups"]
        assert target == 4 and not sampling["cap_hit"] and len(sampling["selected"]) == target
        # The generation calls were exactly the recorded rounds: the first with TRL's generation batch, each extra
        # one with the shortfall over the informative fraction seen so far (at most a generation batch).
        found = generated_groups = 0
        for index, (groups, informative) in enumerate(zip(sampling["round_groups"], sampling["informative"])):
            prompts = next(calls)
            assert len(prompts) == groups * 4 == informative.numel() * 4
            assert all(len(set(prompts[g * 4 : g * 4 + 4])) == 1 for g in range(groups)), "4 rows per prompt"
            if index == 0:
                assert groups == target
            else:
                fraction = max(Fraction(found, generated_groups), MIN_INFORMATIVE_FRACTION)
                assert groups == min(ceil((target - found) / fraction), target)
                smaller += groups < target
            found += int(informative.sum())
            generated_groups += groups
        assert per_kept == pytest.approx(generated_groups / target)
        # The batch trained on: 16 rows, every kept group mixed, each row with its own reward.
        assert generated["completion_ids"].size(0) == 16
        correctness = batch["rewards_per_func"][:, 0].view(-1, 4) > 0
        assert (correctness.any(dim=1) & ~correctness.all(dim=1)).all(), "every kept group is mixed"
        prompts, completions = texts(trainer, generated)
        recomputed = mostly_informative_reward(completions, answers_of(trainer, prompts))
        torch.testing.assert_close(batch["rewards_per_func"][:, 0], torch.tensor(recomputed))
    assert next(calls, None) is None, "no generation call outside the recorded rounds"
    assert smaller > 0, "some extra round generates fewer groups than a generation batch"

    # Same seed, same rounds and same batches.
    again = RoundRecording(
        tiny_model_dir,
        mostly_informative_reward,
        config(tmp_path / "again", **settings),
        train_dataset=make_prompt_dataset(),
    )
    again.train()
    assert again.round_inputs == trainer.round_inputs
    for first, second in zip(trainer.generated, again.generated, strict=True):
        assert first["batch"]["dynamic_sampling"]["selected"] == second["batch"]["dynamic_sampling"]["selected"]
        assert torch.equal(first["completion_ids"], second["completion_ids"])


def test_first_round_extra_groups_are_whole_groups_on_every_process():
    from egpo_trl.sampling.dynamic import first_round_extra_groups

    assert first_round_extra_groups(1.0, 64, 8) == 0
    assert first_round_extra_groups(1.5, 8, 1) == 4
    assert first_round_extra_groups(1.1, 10, 1) == 1  # read as written: 11/10, not the float just above it
    assert first_round_extra_groups(1.25, 64, 8) == 16
    assert first_round_extra_groups(1.1, 64, 8) == 8  # 6.4 -> 7 -> a multiple of the 8 processes
    assert first_round_extra_groups(1.01, 4, 2) == 2


def test_the_suggested_oversample_is_the_largest_that_fits():
    from fractions import Fraction

    from egpo_trl.sampling.dynamic import first_round_extra_groups, largest_oversample

    def first_round(f: Fraction, target: int, processes: int) -> int:
        return target + first_round_extra_groups(float(f), target, processes)

    step = Fraction(1, 1000)
    for processes in (1, 2, 3, 8):
        for target in range(1, 40):
            for distinct in range(target, 3 * target + 20):
                largest = largest_oversample(distinct, target, processes)
                if largest is None:  # not even the smallest oversampling fits
                    assert first_round(1 + step, target, processes) > distinct, (processes, target, distinct)
                    continue
                # It fits, adds a group, and one thousandth more does not fit (the groups grow with the value).
                assert target < first_round(largest, target, processes) <= distinct, (processes, target, distinct)
                assert first_round(largest + step, target, processes) > distinct, (processes, target, distinct)


def test_oversampling_settings_are_checked(tmp_path, tiny_model_dir, monkeypatch):
    from pathlib import Path

    from egpo_trl import EGPOTrainer

    monkeypatch.chdir(Path(__file__).resolve().parents[1])

    with pytest.raises(ValueError, match="dynamic_sampling is off"):
        config(tmp_path, dynamic_sampling_oversample=1.5)
    with pytest.raises(ValueError, match="dynamic_sampling_oversample must be a number >= 1"):
        config(tmp_path, dynamic_sampling=True, dynamic_sampling_oversample=0.5)
    # Each process's share of a generation batch must be whole groups. With 8 processes, 2 rows x 4 accumulation
    # steps each and groups of 16, TRL accepts the batch (64 rows, 4 groups, each split over two processes), but no
    # whole group can be added to a share: refused when the config is parsed, so --dry-run lists it on any machine.
    from egpo_trl.launch import check_recipe

    report = check_recipe(["--config", "recipes/dapo_qwen15b.yaml", "--num_processes", "8",
                           "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4",
                           "--dynamic_sampling_oversample", "1.5"])  # fmt: skip
    (problem,) = [p for p in report.problems if "dynamic_sampling_oversample" in p]
    assert "(2 x 4 = 8) must be a multiple of num_generations (16)" in problem
    assert "dynamic_sampling_oversample: 1.0" in problem
    # The recipe oversamples by default: the same batch is refused without the override, and accepted with the fix
    # the message names.
    report = check_recipe(["--config", "recipes/dapo_qwen15b.yaml", "--num_processes", "8",
                           "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4"])  # fmt: skip
    assert [p for p in report.problems if "dynamic_sampling_oversample" in p] == [problem]
    report = check_recipe(["--config", "recipes/dapo_qwen15b.yaml", "--num_processes", "8",
                           "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4",
                           "--dynamic_sampling_oversample", "1.0"])  # fmt: skip
    assert not [p for p in report.problems if "dynamic_sampling_oversample" in p]
    # A trainer with whole groups per process starts.
    args = config(tmp_path, dynamic_sampling=True, dynamic_sampling_oversample=1.5)
    trainer = EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    assert trainer.args is args
    # A first round with more groups than the training set has prompts would repeat prompts: refused.
    # Counted in distinct prompts (the 8 of make_prompt_dataset, stored twice here), and the value the message
    # suggests is accepted.
    import re

    from datasets import concatenate_datasets

    twice = concatenate_datasets([make_prompt_dataset(), make_prompt_dataset()])
    target = args.per_device_train_batch_size * args.steps_per_generation // args.num_generations
    for oversample in (8 / target + 0.5, 8 / target + 0.001):
        args = config(tmp_path, dynamic_sampling=True, dynamic_sampling_oversample=oversample)
        with pytest.raises(ValueError, match=f"first round {target} \\+ [0-9]+ groups.*has 8 distinct prompts") as e:
            EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=twice)
        suggested = float(re.search(r"at most ([0-9.]+) here", str(e.value)).group(1))
        args = config(tmp_path, dynamic_sampling=True, dynamic_sampling_oversample=suggested)
        assert EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=twice).args is args


def test_the_dry_run_shows_the_first_rounds_size_and_how_to_turn_dynamic_sampling_off(monkeypatch):
    """The dry run gives the oversampled first round's real size (the added groups are rounded up to whole groups per
    process, so the factor can exceed the one set), and turning dynamic sampling off in a recipe that oversamples is
    refused with the override that makes it run."""
    from pathlib import Path

    from egpo_trl.launch import check_recipe

    monkeypatch.chdir(Path(__file__).resolve().parents[1])

    def dry_run(*extra):
        report = check_recipe(["--config", "recipes/dapo_qwen15b.yaml", *extra])
        return dict(report.settings).get("dynamic sampling"), [p for p in report.problems if "dynamic_sampling" in p]

    line, problems = dry_run("--num_processes", "8")
    assert problems == []
    assert line == ("up to 10 rounds per generation batch (correctness); first round 64 + 32 groups (1.5x), "
                    "1536 completions, 192 per process")  # fmt: skip
    # one group per process per generation batch: half a group more each is rounded up to a whole one
    line, _ = dry_run("--num_processes", "8", "--gradient_accumulation_steps", "1")
    assert "first round 8 + 8 groups (2x), 256 completions, 32 per process" in line
    line, _ = dry_run("--num_processes", "8", "--dynamic_sampling_oversample", "1.0")
    assert line == "up to 10 rounds per generation batch (correctness)"

    # the engine's max_num_seqs on the vLLM line: a colocated engine over 2 processes decodes both processes' prompts,
    # the oversampled first round's where there is one (as kv_cache_line and the trainer give it)
    def engine(*extra):
        report = check_recipe(["--config", "recipes/dapo_qwen15b.yaml", "--num_processes", "8", *extra])
        return dict(report.settings)["vLLM"]

    assert engine().endswith("tensor_parallel_size 1, max_num_seqs 192 per engine (the oversampled first round)")
    assert engine("--vllm_tensor_parallel_size", "2").endswith(
        "max_num_seqs 384 per engine (the oversampled first round)"
    )
    assert engine("--vllm_tensor_parallel_size", "2", "--dynamic_sampling_oversample", "1.0").endswith(
        "tensor_parallel_size 2, max_num_seqs 256 per engine"
    )
    assert "max_num_seqs" not in engine("--vllm_mode", "server")  # a server's engine is not the processes' own

    line, problems = dry_run("--dynamic_sampling", "false")
    assert line is None and len(problems) == 1
    assert "add --dynamic_sampling_oversample 1.0 to --dynamic_sampling false" in problems[0]
    line, problems = dry_run("--dynamic_sampling", "false", "--dynamic_sampling_oversample", "1.0")
    assert line is None and problems == []


@pytest.mark.slow
def test_an_oversampled_first_round_keeps_the_batchs_own_groups_first(tmp_path, tiny_model_dir):
    from fractions import Fraction
    from math import ceil

    from egpo_trl.sampling.dynamic import MIN_INFORMATIVE_FRACTION

    # Generation batches of 4 groups of 4; the first round adds 2 groups (1.5x) drawn from the training set.
    # The completions table on (TRL keeps it in deques of a generation batch's length; the first round is longer).
    settings = dict(max_steps=4, per_device_train_batch_size=16, dynamic_sampling=True, dynamic_sampling_max_rounds=8,
                    dynamic_sampling_oversample=1.5, log_completions=True)  # fmt: skip
    trainer = RoundRecording(
        tiny_model_dir, mostly_informative_reward, config(tmp_path, **settings), train_dataset=make_prompt_dataset()
    )
    trainer.train()

    calls = iter(trainer.round_inputs)
    one_round = 0
    for generated, per_kept in zip(trainer.generated, history(trainer, "dynamic_sampling/generated_per_kept")):
        sampling = generated["batch"]["dynamic_sampling"]
        assert sampling["target_groups"] == 4 and sampling["first_round_extra_groups"] == 2
        assert not sampling["cap_hit"] and len(sampling["selected"]) == 4
        first = next(calls)
        assert len(first) == 24 == sampling["round_groups"][0] * 4
        assert all(len(set(first[g * 4 : g * 4 + 4])) == 1 for g in range(6)), "4 rows per prompt"
        informative = sampling["informative"][0]
        # The generation batch's own informative groups are kept first, in order, then the added ones.
        own = [g for g in range(4) if informative[g]]
        added = [g for g in range(4, 6) if informative[g]]
        assert sampling["selected"][: len(own)] == [(0, g) for g in own]
        assert sampling["selected"][len(own) : len(own) + len(added)] == [(0, g) for g in added][: 4 - len(own)]
        found, generated_groups = int(informative.sum()), 6
        for groups, flags in zip(sampling["round_groups"][1:], sampling["informative"][1:]):
            assert len(next(calls)) == groups * 4
            fraction = max(Fraction(found, generated_groups), MIN_INFORMATIVE_FRACTION)
            assert groups == min(ceil((4 - found) / fraction), 4)
            found += int(flags.sum())
            generated_groups += groups
        one_round += sampling["rounds"] == 1
        assert per_kept == pytest.approx(generated_groups / 4)
        # The batch trained on: 16 rows of informative groups, each row with its own reward.
        assert generated["completion_ids"].size(0) == 16
        correctness = generated["batch"]["rewards_per_func"][:, 0].view(-1, 4) > 0
        assert (correctness.any(dim=1) & ~correctness.all(dim=1)).all()
        prompts, completions = texts(trainer, generated)
        recomputed = mostly_informative_reward(completions, answers_of(trainer, prompts))
        torch.testing.assert_close(generated["batch"]["rewards_per_func"][:, 0], torch.tensor(recomputed))
    assert next(calls, None) is None
    assert one_round > 0, "the added groups make up for uninformative ones in one round"
    # The completions table holds the last batch's 16 kept rows, with their rewards and the advantages the loss used.
    last = trainer.generated[-1]
    assert len(trainer._logs["prompt"]) == len(trainer._logs["completion"]) == 16
    assert trainer._logs["prompt"].maxlen == 16, "TRL's own deques are back"
    assert (
        list(trainer._logs["rewards"]["mostly_informative_reward"]) == last["batch"]["rewards_per_func"][:, 0].tolist()
    )
    assert list(trainer._logs["advantages"]) == last["batch"]["result"].advantages.tolist()
    prompts, completions = texts(trainer, last)
    logged = [c[0]["content"] if isinstance(c, list) else c for c in trainer._logs["completion"]]
    assert logged == completions


@pytest.mark.slow
def test_extra_prompts_are_not_the_batchs_own_nor_repeated_across_its_rounds(tmp_path, tiny_model_dir):
    from datasets import concatenate_datasets

    # 16 distinct prompts, each stored in two rows, 4 of them uninformative; batches of 4 groups, 2 added to the first
    # round, at most 3 rounds: a step draws at most 2 + 4 + 4 extra prompts, so fresh ones never run out.
    settings = dict(max_steps=3, per_device_train_batch_size=16, dynamic_sampling=True, dynamic_sampling_max_rounds=3,
                    dynamic_sampling_oversample=1.5)  # fmt: skip
    dataset = concatenate_datasets([make_prompt_dataset(16), make_prompt_dataset(16)])
    trainer = RoundRecording(
        tiny_model_dir, mostly_informative_reward, config(tmp_path, **settings), train_dataset=dataset
    )
    trainer.train()

    calls = iter(trainer.round_inputs)
    extra_rounds = 0
    for generated in trainer.generated:
        sampling = generated["batch"]["dynamic_sampling"]
        first = next(calls)
        own, extra = first[:16:4], first[16::4]  # one prompt per group
        for groups in sampling["round_groups"][1:]:
            prompts = next(calls)
            assert len(prompts) == groups * 4
            extra += prompts[::4]
            extra_rounds += 1
        assert len(own) == 4 and len(extra) >= 2  # (TRL's sampler may put both rows of a prompt in one batch)
        assert not set(extra) & set(own), "an extra group repeats a prompt of the generation batch"
        assert len(set(extra)) == len(extra), "a prompt drawn twice for one generation batch"
    assert next(calls, None) is None
    assert extra_rounds > 0, "some step needed a round after the first"


def test_two_generation_batches_of_one_step_draw_different_extra_prompts(tmp_path, tiny_model_dir):
    """steps_per_generation < gradient_accumulation_steps: one optimizer step generates several batches (at
    micro-steps 0 and 2 here), whose extra prompts come from draws of their own (one draw would put the same prompts
    twice into one update); the same micro-step draws the same prompts again (a resumed run)."""
    from itertools import islice

    from egpo_trl import EGPOTrainer

    settings = dict(per_device_train_batch_size=8, steps_per_generation=2, gradient_accumulation_steps=4,
                    dynamic_sampling=True, dynamic_sampling_oversample=1.5)  # fmt: skip
    dataset = make_prompt_dataset(64)
    trainer = EGPOTrainer(tiny_model_dir, parity_reward, config(tmp_path, **settings), train_dataset=dataset)
    batch = [dataset[i] for i in range(4) for _ in range(4)]

    def draw(micro_step: int) -> list[int]:
        trainer._step = micro_step
        return list(islice(trainer._extra_prompts(batch), 8))

    assert draw(0) != draw(2) and draw(2) == draw(2)
    assert not {0, 1, 2, 3} & set(draw(0) + draw(2)), "the batch's own prompts are skipped"


@pytest.mark.parametrize(
    "settings, dropped, kept",
    [
        (dict(advantage_estimator="egpo"), "entirely incorrect groups,", None),
        (dict(advantage_estimator="egpo", egpo_nsr=False), None, None),  # learns from mixed groups only, as GRPO
        (dict(advantage_estimator="egpo", dynamic_sampling_metric="reward"), "entirely incorrect groups whose total",
         "keeps the entirely correct groups"),
        (dict(advantage_estimator="egpo", egpo_nsr=False, dynamic_sampling_metric="reward"), None,
         "keeps the entirely correct and entirely incorrect groups"),
        (dict(advantage_estimator="nsr"), "entirely incorrect groups,", None),
        (dict(advantage_estimator="nsr", nsr_positive_weight=0.5), "entirely incorrect and entirely correct", None),
        (dict(advantage_estimator="nsr", dynamic_sampling_metric="reward"), "entirely incorrect groups whose total",
         "keeps the entirely correct groups"),
        (dict(advantage_estimator="grpo", dynamic_sampling_metric="reward"), None, None),
    ],
)  # fmt: skip
def test_dynamic_sampling_says_which_groups_it_drops_that_the_estimator_learns_from(
    tmp_path, tiny_model_dir, caplog, settings, dropped, kept
):
    from egpo_trl import EGPOTrainer

    args = config(tmp_path, dynamic_sampling=True, **settings)
    with caplog.at_level(logging.WARNING, logger="egpo_trl.sampling.dynamic"):
        EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    said = [r.getMessage() for r in caplog.records if "informative under GRPO" in r.getMessage()]
    assert len(said) == (1 if dropped or kept else 0), said
    if said:
        assert (f"drops the {dropped}" in said[0]) if dropped else "it drops" not in said[0]
        assert (kept in said[0]) if kept else "it keeps the" not in said[0]


def shaping_reward(completions, **kwargs):
    """A small reward that varies within almost every group (the completion's length, in thousandths)."""
    from egpo_trl.rewards import completion_text

    return [len(completion_text(c)) / 1000 for c in completions]


@pytest.mark.slow
def test_the_correctness_reward_decides_wherever_it_stands_among_several(tmp_path, tiny_model_dir):
    """Two reward functions, the correctness one second: dynamic sampling judges groups by that column (the shaping
    reward makes almost every group's total vary), and each kept row keeps both of its rewards."""
    settings = dict(max_steps=3, dynamic_sampling=True, dynamic_sampling_max_rounds=8, advantage_estimator="grpo",
                    egpo_correctness_reward="half_informative_reward", reward_weights=[1.0, 1.0])  # fmt: skip
    trainer = RoundRecording(
        tiny_model_dir,
        [shaping_reward, half_informative_reward],
        config(tmp_path, **settings),
        train_dataset=make_prompt_dataset(),
    )
    assert trainer._egpo_correctness_index == 1
    trainer.train()
    assert sum(history(trainer, "dynamic_sampling/rounds")) > 3, "uniform groups were dropped, by correctness"
    for generated in trainer.generated:
        rewards = generated["batch"]["rewards_per_func"]
        correct = rewards[:, 1].view(-1, 4) > 0
        assert (correct.any(dim=1) & ~correct.all(dim=1)).all(), "every kept group is mixed in correctness"
        prompts, completions = texts(trainer, generated)
        torch.testing.assert_close(rewards[:, 0], torch.tensor(shaping_reward(completions)))
        torch.testing.assert_close(
            rewards[:, 1], torch.tensor(half_informative_reward(completions, answers_of(trainer, prompts)))
        )


def test_an_oversampled_engine_is_started_for_the_first_rounds_sequences():
    """The max_num_seqs the colocated engine gets with an oversampled first round: this process's rows of the batch
    and of the added groups, times the tensor-parallel group (TRL's formula for a generation batch, with the groups)."""
    from types import SimpleNamespace

    from egpo_trl.sampling.dynamic import colocated_engine_sequences

    # The DAPO 1.5B recipe on 8 GPUs: 128 rows each (8 groups), 64 groups; 1.5x adds 32 groups, 4 per process.
    args = SimpleNamespace(per_device_train_batch_size=16, steps_per_generation=8, num_generations=16, world_size=8,
                           vllm_tensor_parallel_size=1, dynamic_sampling=True, dynamic_sampling_oversample=1.5)  # fmt: skip
    assert colocated_engine_sequences(args) == (128 + 4 * 16, True)
    # Tensor parallelism over pairs of processes: each engine decodes both processes' prompts.
    args.vllm_tensor_parallel_size = 2
    assert colocated_engine_sequences(args) == (2 * (128 + 4 * 16), True)
    # 1.1 of 64 groups: 6.4 -> 7 -> 8 added groups, one per process.
    args.vllm_tensor_parallel_size, args.dynamic_sampling_oversample = 1, 1.1
    assert colocated_engine_sequences(args) == (128 + 16, True)
    args.dynamic_sampling = False  # no oversampling: the generation batch's rows
    assert colocated_engine_sequences(args) == (128, False)


def sometimes_noted_reward(completions, answer, log_extra=None, **kwargs):
    """mostly_informative_reward that adds a completions-table column on its first call only, as a reward may."""
    sometimes_noted_reward.calls = getattr(sometimes_noted_reward, "calls", 0) + 1
    if log_extra is not None and sometimes_noted_reward.calls == 1:
        log_extra("note", ["first call"] * len(completions))
    return mostly_informative_reward(completions, answer)


@pytest.mark.slow
def test_an_oversampled_round_keeps_every_completions_table_column_at_the_tables_length(tmp_path, tiny_model_dir):
    """A column that an oversampled round did not log (here: logged in the first step only) gets None on its rows;
    every column keeps the kept batch's length, and TRL's table prints at every log."""
    sometimes_noted_reward.calls = 0
    settings = dict(max_steps=3, per_device_train_batch_size=16, dynamic_sampling=True, dynamic_sampling_max_rounds=8,
                    dynamic_sampling_oversample=1.5, log_completions=True)  # fmt: skip
    trainer = RoundRecording(
        tiny_model_dir, sometimes_noted_reward, config(tmp_path, **settings), train_dataset=make_prompt_dataset()
    )
    trainer.train()
    assert trainer.state.global_step == 3
    note = list(trainer._logs["extra"]["note"])
    assert len(note) == len(trainer._logs["prompt"]) == 16 and note == [None] * 16
    assert trainer._logs["extra"]["note"].maxlen == 16


def failing_on_second_step_reward(completions, answer, **kwargs):
    failing_on_second_step_reward.calls = getattr(failing_on_second_step_reward, "calls", 0) + 1
    if failing_on_second_step_reward.calls > 1:
        raise RuntimeError("reward service unavailable")
    return mostly_informative_reward(completions, answer)


@pytest.mark.slow
def test_an_oversampled_round_that_fails_leaves_trls_own_logs(tmp_path, tiny_model_dir):
    """An error inside an oversampled round (a reward function that raises) propagates, and the trainer is left with
    TRL's own completions-table deques (a generation batch long, as the last finished batch left them)."""
    failing_on_second_step_reward.calls = 0
    settings = dict(max_steps=3, per_device_train_batch_size=16, dynamic_sampling=True, dynamic_sampling_max_rounds=1,
                    dynamic_sampling_oversample=1.5, log_completions=True)  # fmt: skip
    trainer = RoundRecording(
        tiny_model_dir,
        failing_on_second_step_reward,
        config(tmp_path, **settings),
        train_dataset=make_prompt_dataset(),
    )
    logs = trainer._logs
    with pytest.raises(RuntimeError, match="reward service unavailable"):
        trainer.train()
    assert trainer._logs is logs and trainer._logs["prompt"].maxlen == 16
    assert len(trainer._logs["prompt"]) == len(trainer._logs["advantages"]) == 16  # the first step's kept batch
    assert list(trainer._logs["advantages"]) == trainer.generated[0]["batch"]["result"].advantages.tolist()


def odd_calls_noted_reward(completions, answer, log_extra=None, **kwargs):
    """mostly_informative_reward that adds a completions-table column on its odd-numbered calls (one call per
    generation round), each row's value naming the call and the row."""
    odd_calls_noted_reward.calls += 1
    call = odd_calls_noted_reward.calls
    if log_extra is not None and call % 2:
        log_extra("note", [f"call {call} row {i}" for i in range(len(completions))])
    return mostly_informative_reward(completions, answer)


class TableRecording(RoundRecording):
    """Also keeps the completions table's note column after each generation batch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.notes = []

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.notes.append(list(self._logs["extra"].get("note", [])))
        return output


@pytest.mark.slow
@pytest.mark.parametrize("oversample", [1.0, 1.5])
def test_the_completions_table_shows_each_kept_rows_own_logged_values(tmp_path, tiny_model_dir, oversample):
    """Rounds that log different columns: each kept row shows the value its own round logged for it, or None where
    its round logged nothing (never a value of another round, row or step)."""
    odd_calls_noted_reward.calls = 0
    settings = dict(max_steps=6, per_device_train_batch_size=16, dynamic_sampling=True, dynamic_sampling_max_rounds=8,
                    dynamic_sampling_oversample=oversample, log_completions=True)  # fmt: skip
    trainer = TableRecording(
        tiny_model_dir, odd_calls_noted_reward, config(tmp_path, **settings), train_dataset=make_prompt_dataset()
    )
    trainer.train()
    call = 0
    mixed = 0
    for generated, notes in zip(trainer.generated, trainer.notes, strict=True):
        sampling = generated["batch"]["dynamic_sampling"]
        calls = list(range(call + 1, call + 1 + sampling["rounds"]))  # one reward call per round
        call = calls[-1]
        mixed += len({c % 2 for c in calls}) > 1
        if not any(c % 2 for c in calls):
            assert notes == [] or notes == [None] * 16
            continue
        expected = []
        for r, g in sampling["selected"]:
            for j in range(4):
                expected.append(f"call {calls[r]} row {g * 4 + j}" if calls[r] % 2 else None)
        assert notes == expected
    assert mixed > 0, "some generation batch kept rows of rounds that logged the column and of rounds that did not"
