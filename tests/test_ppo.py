"""PPO math on hand-computed values, composable rewards, and PPO/GRPO end to end on a learnable toy reward."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from tiny_checkpoint import make_tiny_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from smolctl.errors import UserError
from smolctl.train.config import load_command_recipe
from smolctl.train.grpo import run_grpo
from smolctl.train.ppo import run_ppo
from smolctl.train.ppo_loop import PpoLoop
from smolctl.train.ppo_math import (
    clipped_policy_loss,
    clipped_value_loss,
    completion_mask,
    explained_variance,
    gae,
    token_logprobs,
    whiten,
)
from smolctl.train.rewards import CompositeReward, RewardSection, group_diversity
from smolctl.train.rl_setup import prepare

# ---------------------------------------------------------------------------------------------------------------
# The math


def test_gae_matches_hand_computed_values():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # δ2 = 1 - 0.7 = 0.3;  δ1 = 0.7 - 0.6 = 0.1 → A1 = 0.1 + 0.5·0.3 = 0.25;  δ0 = 0.1 → A0 = 0.1 + 0.5·0.25
    assert torch.allclose(advantages, torch.tensor([[0.225, 0.25, 0.3]]))
    assert torch.allclose(returns, torch.tensor([[0.725, 0.85, 1.0]]))


def test_gae_does_not_bootstrap_past_the_end_of_a_completion():
    rewards = torch.tensor([[0.0, 2.0, 9.0]])
    values = torch.tensor([[1.0, 1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is padding after the stop token
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=1.0)
    # A1 = 2 - 1 = 1 (no 0.9·V2 bootstrap);  A0 = (0 + 0.9·1 - 1) + 0.9·1 = 0.8;  padding stays 0
    assert torch.allclose(advantages, torch.tensor([[0.8, 1.0, 0.0]]))
    assert torch.allclose(returns, torch.tensor([[1.8, 2.0, 0.0]]))


def test_clipped_policy_loss_matches_hand_computed_values():
    ratios = torch.tensor([[1.5, 0.5, 0.5, 1.5]])
    old = torch.zeros(1, 4)
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, clipfrac = clipped_policy_loss(torch.log(ratios), old, advantages, torch.ones(1, 4), clip=0.2)
    # per token max(-A·r, -A·clip(r)): -1.2 (clipped), -0.5, 0.8 (clipped), 1.5 → mean 0.15, half clipped
    assert loss.item() == pytest.approx(0.15, abs=1e-6)
    assert clipfrac.item() == pytest.approx(0.5)
    masked, _ = clipped_policy_loss(torch.log(ratios), old, advantages, torch.tensor([[1.0, 1.0, 0.0, 0.0]]), 0.2)
    assert masked.item() == pytest.approx((-1.2 - 0.5) / 2, abs=1e-6)


def test_clipped_value_loss_matches_hand_computed_values():
    values = torch.tensor([[1.0, 0.0]])
    old_values = torch.tensor([[0.5, 0.5]])
    returns = torch.tensor([[1.0, 1.0]])
    loss = clipped_value_loss(values, old_values, returns, torch.ones(1, 2), clip=0.2)
    # token 0: V=1 → (0)², clipped 0.7 → 0.09; max 0.09.  token 1: V=0 → 1, clipped 0.3 → 0.49; max 1
    assert loss.item() == pytest.approx(0.5 * (0.09 + 1.0) / 2, abs=1e-6)


def test_whiten_and_completion_mask():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    white = whiten(values, mask)
    assert white[0, :3].mean().item() == pytest.approx(0.0, abs=1e-5)
    assert white[0, 3].item() == 0.0
    completion = torch.tensor([[5, 7, 3, 9, 9], [5, 6, 7, 8, 4]])
    assert completion_mask(completion, [3, 0]).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]


def test_explained_variance_is_one_for_a_perfect_critic_and_zero_for_the_mean():
    returns = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.0), returns, mask) == pytest.approx(0.0, abs=1e-6)
    assert explained_variance(-returns, returns, mask) < 0


def test_chunked_token_logprobs_equal_the_full_log_softmax_in_value_and_gradient():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    tokens = torch.randint(0, 50, (2, 5))
    logprobs, entropy = token_logprobs(hidden, head, tokens, temperature=0.7, entropy=True, chunk_elements=3 * 50)
    full = torch.log_softmax(head(hidden) / 0.7, dim=-1)
    expected = full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(logprobs, expected, atol=1e-6)
    assert torch.allclose(entropy, -(full.exp() * full).sum(-1), atol=1e-5)
    (grad,) = torch.autograd.grad((logprobs + entropy).sum(), hidden)
    (expected_grad,) = torch.autograd.grad((expected - (full.exp() * full).sum(-1)).sum(), hidden)
    assert torch.allclose(grad, expected_grad, atol=1e-5)


def test_chunked_token_logprobs_keep_no_vocabulary_logits_for_backward():
    """Each chunk is checkpointed: what autograd keeps is the hidden states, not a chunk's [positions, vocabulary]
    logits (without the checkpoint every chunk's logits would stay alive until backward)."""
    head = torch.nn.Linear(16, 4096, bias=False)
    hidden = torch.randn(4, 32, 16, requires_grad=True)
    tokens = torch.randint(0, 4096, (4, 32))
    saved: list[int] = []

    def keep(tensor):
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logprobs, entropy = token_logprobs(hidden, head, tokens, 1.0, entropy=True, chunk_elements=8 * 4096)
    (logprobs.sum() + entropy.sum()).backward()
    assert sum(saved) < 4 * 32 * 4096 / 8, f"autograd kept {sum(saved)} elements"
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()


# ---------------------------------------------------------------------------------------------------------------
# Rewards


def nan_reward(row: dict) -> float:
    return math.nan if "x" in row["completion"] else 1.0


def failing_reward(row: dict) -> float:
    if "b" in row["completion"]:
        raise ValueError("cannot parse")
    return 1.0


def batched_reward(rows: list[dict]) -> list[float]:
    """Sees every column of each row: the prompt, the completion, the reference, and `id`."""
    return [float(row["completion"] in row["prompt"]) + row["id"] / 100 for row in rows]


def spaced_words(row: dict) -> float:
    """A toy reward a random tiny model learns within a dozen steps: about the share of its 6 tokens that start a
    word (~0.45 at random, 1.0 for e.g. " the the the ..."). Dense and without plateaus below the optimum; a
    share-of-characters reward instead traps GRPO at a repeated common word (0.25)."""
    return min(1.0, row["completion"].count(" ") / 6)


def test_task_rewards_exact_regex_and_callable():
    exact = CompositeReward([RewardSection(kind="task")])
    assert exact.score(["  `Numbers`. ", "math"], [3, 1], ["numbers", "numbers"]).totals == [1.0, 0.0]
    pattern = CompositeReward([RewardSection(kind="task", match="regex", pattern=r"\b{reference}\b")])
    assert pattern.score(["it is in os.path", "ospath"], [4, 1], ["os.path", "os.path"]).totals == [1.0, 0.0]
    fixed = CompositeReward([RewardSection(kind="task", match="regex", pattern=r"^\d+$")])
    assert not fixed.needs_reference and fixed.score(["42", "4x"], [1, 1]).totals == [1.0, 0.0]
    called = CompositeReward([RewardSection(kind="task", match="callable", function="test_ppo:spaced_words")])
    assert called.score([" a b", "ab"], [2, 1], [None, None]).totals == pytest.approx([2 / 6, 0.0])


def test_the_default_regex_matches_the_final_answer_on_word_boundaries():
    final = CompositeReward([RewardSection(kind="task", match="regex")])
    texts = ["so the answer is 4.", "the answer is 14", "4 apples, no: 5", "3.4", "4"]
    assert final.score(texts, [1] * 5, ["4"] * 5).totals == [1.0, 0.0, 0.0, 0.0, 1.0]


def test_reward_callables_see_the_whole_row_singly_or_batched():
    rows = [{"id": 3, "prompt": "say hi", "reference": None}, {"id": 5, "prompt": "say hi", "reference": None}]
    batched = CompositeReward(
        [RewardSection(kind="task", match="callable", function="test_ppo:batched_reward", batched=True)]
    )
    assert batched.score(["hi", "bye"], [1, 1], rows=rows).totals == pytest.approx([1.03, 0.05])


def test_a_failing_reward_names_itself_and_the_row_or_is_counted_and_skipped():
    section = dict(kind="task", match="callable", function="test_ppo:failing_reward")
    rows = [{"prompt": "p1", "reference": None}, {"prompt": "p2", "reference": None}]
    with pytest.raises(
        UserError,
        match=r"rewards\[0\]\.function: test_ppo:failing_reward raised ValueError: "
        r"cannot parse on row 1 \(prompt='p2'.*completion='abc'",
    ):
        CompositeReward([RewardSection(**section)]).score(["ok", "abc"], [1, 1], rows=rows)
    skipping = CompositeReward([RewardSection(**section, on_error="skip")])
    totals = skipping.score(["ok", "abc"], [1, 1], rows=rows).totals
    assert totals[0] == 1.0 and math.isnan(totals[1]) and skipping.errors == {"task": 1}


def test_diversity_is_over_the_group_and_short_texts_earn_nothing():
    assert group_diversity(["yes", ""], 2) == [0.0, 0.0]  # shorter than n words: no bonus
    assert group_diversity(["a b c", "a b c", "x y z"], 2) == [0.0, 0.0, 1.0]  # copies of a sibling: no bonus
    assert group_diversity(["a a a a a"], 2) == [0.25]  # one distinct bigram of four
    reward = CompositeReward([RewardSection(kind="diversity", n=2)])
    assert reward.score(["a b c", "a b c"], [3, 3], groups=[0, 1]).components["diversity"] == [1.0, 1.0]


def test_truncated_completions_score_the_truncated_penalty():
    reward = CompositeReward([RewardSection(kind="task"), RewardSection(kind="length", truncated_penalty=-1.0)])
    scored = reward.score(["numbers", "numbers"], [3, 3], ["numbers", "numbers"], truncated=[False, True])
    assert scored.totals == [pytest.approx(math.exp(-0.03)), -1.0]


def test_a_reward_model_folder_scores_prompt_and_completion(tokenizer_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification, SmolLM3Config

    from smolctl.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    torch.manual_seed(0)
    config = SmolLM3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    reward = CompositeReward([RewardSection(kind="model", path=str(tmp_path / "rm"), weight=2.0)])
    rows = [{"prompt": "What is 2+2?"}, {"prompt": "Name a colour."}, {"prompt": "What is 2+2?"}]
    scored = reward.score(["4", "4", "five"], [1, 1, 1], rows=rows)
    values = scored.components["model"]
    assert len(set(values)) == 3  # the prompt and the completion both count
    alone = CompositeReward([RewardSection(kind="model", path=str(tmp_path / "rm"))])
    assert alone.score(["4"], [1], rows=rows[:1]).components["model"] == pytest.approx(values[:1], abs=1e-5)
    assert scored.totals == pytest.approx([2 * v for v in values])
    with pytest.raises(UserError, match=r"rewards\[0\]\.path: .* is not a folder"):
        CompositeReward([RewardSection(kind="model", path=str(tmp_path / "nothing"))])


def test_in_the_3b_recipe_a_long_correct_answer_beats_a_short_wrong_one():
    recipe = load_command_recipe("ppo", "recipes/smollm3-ppo.toml")
    reward = CompositeReward(recipe.rewards)
    correct, wrong = "the answer is 4 " + "because " * 394 + "4", "5"
    scored = reward.score([correct, wrong], [400, 1], ["4", "4"], groups=[0, 0])
    assert scored.totals[0] > scored.totals[1] + 0.3, scored


def test_shaped_reward_is_task_times_length_penalty_plus_diversity_bonus():
    reward = CompositeReward(
        [
            RewardSection(kind="task"),
            RewardSection(kind="length", scale=0.01),
            RewardSection(kind="diversity", n=2, weight=0.1),
        ]
    )
    scored = reward.score(["numbers", "a a a a a"], [10, 50], ["numbers", "numbers"])
    assert scored.totals[0] == pytest.approx(1.0 * math.exp(-0.1) + 0.0)  # one word: no diversity bonus
    assert scored.totals[1] == pytest.approx(0.0 + 0.1 * 0.25)  # bigrams: (a a) x4, one distinct
    assert scored.components["length"] == pytest.approx([math.exp(-0.1), math.exp(-0.5)])


def test_reward_callable_that_does_not_import_is_a_user_error():
    with pytest.raises(UserError, match="cannot import module 'no_such_rewards'"):
        CompositeReward([RewardSection(kind="task", match="callable", function="no_such_rewards:score")])
    with pytest.raises(UserError, match="has no function 'missing'"):
        CompositeReward([RewardSection(kind="task", match="callable", function="test_ppo:missing")])
    with pytest.raises(UserError, match="module:function"):
        CompositeReward([RewardSection(kind="task", match="callable", function="just_a_name")])
    with pytest.raises(UserError, match=r"rewards\[0\].pattern: is not a valid regular expression"):
        CompositeReward([RewardSection(kind="task", match="regex", pattern="([unclosed")])
    with pytest.raises(UserError, match="no rewards"):
        CompositeReward([])


# ---------------------------------------------------------------------------------------------------------------
# End to end on the tiny model


@pytest.fixture(scope="module")
def tiny_model(tokenizer_dir, tmp_path_factory):
    return make_tiny_checkpoint(tokenizer_dir, tmp_path_factory.mktemp("ppo") / "pre")


def toy_recipe(
    tmp_path, reward: str = "test_ppo:spaced_words", match: str = "callable", kind: str = "task", algorithm: str = "ppo"
) -> str:
    path = tmp_path / f"toy-{algorithm}-{reward.replace(':', '-')}-{match}-{kind}.toml"
    path.write_text(
        "\n".join(
            [
                "[data]",
                'path = "data/sample/prompts"',
                "[optimizer]",
                "lr = 3e-2",
                "weight_decay = 0.0",
                "[schedule]",
                'kind = "constant"',
                "[training]",
                "steps = 14",
                "micro_batch = 16",
                "[checkpoint]",
                "interval = 100",
                "[logging]",
                "interval = 1",
                *(
                    ["[grpo]", "num_generations = 8", "max_new_tokens = 6"]
                    if algorithm == "grpo"
                    else [
                        "[ppo]",
                        "batch_size = 16",
                        "minibatch_size = 16",
                        "epochs = 2",
                        "kl_coef = 0.0",
                        "max_new_tokens = 6",
                    ]
                ),
                "[[rewards]]",
                f'kind = "{kind}"',
                f'match = "{match}"',
                *([f'function = "{reward}"'] if match == "callable" else []),
            ]
        )
        + "\n"
    )
    return str(path)


def rewards_logged(run) -> list[float]:
    return [r["reward"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward" in r]


@pytest.fixture(scope="module")
def stubborn_model(tiny_model, tmp_path_factory):
    """The tiny model with a generation_config that would change sampling (greedy-ish: top_k 1, temperature 0.3);
    the rollout must sample as the recipe says all the same."""
    folder = tmp_path_factory.mktemp("stubborn") / "model"
    shutil.copytree(tiny_model, folder)
    (folder / "generation_config.json").write_text(
        json.dumps({"do_sample": False, "top_k": 1, "temperature": 0.3, "top_p": 0.5})
    )
    return folder


def ppo_loop(model, tmp_path, overrides=()) -> PpoLoop:
    recipe = load_command_recipe("ppo", toy_recipe(tmp_path), list(overrides))
    return PpoLoop(recipe, prepare("ppo", recipe, tmp_path / "run", str(model), "none", False), None)


def generated_and_scored_logprobs(loop: PpoLoop, prompts: int = 6):
    """(the rollout's log-probabilities of the sampled tokens, generate's own: log_softmax of its output scores at
    those tokens, completion mask)."""
    torch.manual_seed(1)
    enc = loop.encode([row["prompt"] for row in loop.setup.rows[:prompts]])
    loop.model.eval()
    out = loop.model.policy.generate(
        **enc, generation_config=loop.generation, output_scores=True, return_dict_in_generate=True
    )
    start = enc["input_ids"].shape[1]
    completion = out.sequences[:, start:]
    mask = completion_mask(completion, loop.stop_ids)
    sampled = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in out.scores], dim=1)
    expected = sampled.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    batch = {
        "sequences": out.sequences,
        "attention": torch.cat([enc["attention_mask"], mask.long()], dim=1),
        "prompt_len": start,
    }
    scored, values = loop.score(loop.model, batch)
    assert values.shape == scored.shape == completion.shape
    return scored, expected, mask


def logprobs_agree(scored, expected, mask) -> bool:
    return bool(((scored - expected).abs() * mask).max() < 1e-5)


@pytest.mark.parametrize("shift", [0, 1])
def test_rollout_logprobs_are_those_generate_sampled_with(shift, stubborn_model, tmp_path):
    """The log-probabilities PPO's ratio starts from are those of the distribution that sampled (temperature and
    top_p from the recipe, not the checkpoint's generation_config), token for token; shifted by one token they are
    not, so this check catches an off-by-one in the scoring."""
    loop = ppo_loop(
        stubborn_model, tmp_path, ["ppo.temperature=0.7", "ppo.scoring_micro_batch=4", "ppo.max_new_tokens=8"]
    )
    scored, expected, mask = generated_and_scored_logprobs(loop)
    assert mask.sum() > 12 and (expected * mask).min() < -1.0  # sampled, not greedy: some unlikely tokens
    scored = torch.roll(scored, shifts=shift, dims=1)
    assert logprobs_agree(scored, expected, mask) == (shift == 0)


class LargestLogits(TorchDispatchMode):
    """Records the element count of the largest fp32 tensor over the vocabulary that any operation allocates."""

    def __init__(self, vocabulary: int):
        super().__init__()
        self.vocabulary, self.largest = vocabulary, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # a view (e.g. the LM head's weight expanded for a batched matmul) allocates nothing
            return out
        for tensor in tree_flatten(out)[0]:
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.dtype == torch.float32
                and tensor.shape[-1:] == (self.vocabulary,)
            ):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_scoring_a_rollout_never_builds_batch_by_sequence_by_vocabulary_logits(tiny_model, tmp_path):
    loop = ppo_loop(tiny_model, tmp_path, ["ppo.scoring_micro_batch=2", "ppo.max_new_tokens=8"])
    enc = loop.encode([row["prompt"] for row in loop.setup.rows[:8]])
    loop.model.eval()
    sequences = loop.model.policy.generate(**enc, generation_config=loop.generation)
    start = enc["input_ids"].shape[1]
    mask = completion_mask(sequences[:, start:], loop.stop_ids)
    batch = {
        "sequences": sequences,
        "attention": torch.cat([enc["attention_mask"], mask.long()], dim=1),
        "prompt_len": start,
    }
    vocabulary = loop.model.policy.get_output_embeddings().out_features
    with LargestLogits(vocabulary) as allocations:
        loop.score(loop.model, batch)
        loop.score(loop.reference, batch)
    # at most one micro batch (2 of 8 completions) of logits at a time
    completion_logits = (sequences.shape[1] - start) * vocabulary
    assert 0 < allocations.largest <= 2 * completion_logits, (allocations.largest, completion_logits)


def test_kl_is_zero_at_step_zero_and_the_critic_learns(tiny_model, tmp_path):
    """kl_coef > 0: the reference is the policy's twin, so the first rollout's KL is 0. The critic (its own
    learning rate, here in its warmup, so the policy stays put) fits the returns of a batch: the value loss falls
    and the explained variance of its values rises."""
    loop = ppo_loop(
        tiny_model,
        tmp_path,
        [
            "ppo.kl_coef=0.1",
            "ppo.critic_lr=1e-2",
            "ppo.critic_warmup_steps=100",
            "ppo.vf_clip=100",
            "ppo.epochs=4",
            "ppo.batch_size=8",
            "ppo.minibatch_size=4",
            "training.micro_batch=4",
        ],
    )
    batch = loop.rollout(loop.next_prompts(), 0)
    assert abs(batch["rollout_stats"]["kl"]) < 1e-6 and torch.equal(batch["old_logprobs"], batch["ref_logprobs"])
    assert batch["rollout_stats"]["explained_variance"] == pytest.approx(0.0, abs=1e-6)  # a fresh critic says 0
    policy_before = {n: p.clone() for n, p in loop.model.policy.named_parameters()}
    losses = [loop.update(batch)["value_loss"] for _ in range(4)]
    _, values = loop.score(loop.model, batch)
    assert losses[-1] < losses[0] / 2, losses
    assert explained_variance(values, batch["returns"], batch["mask"]) > 0.3
    assert all(torch.equal(p, policy_before[n]) for n, p in loop.model.policy.named_parameters())


def check_finished_run(run, result, tiny_model, completions_steps: set[int]) -> None:
    """completions.jsonl every completions_interval steps, the summary's reward trend and components, final/'s
    manifest and lineage."""
    logged = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert {line["step"] for line in logged} == completions_steps and "task" in logged[0]["rewards"]
    rewards = rewards_logged(run)
    assert result.metrics["reward_last"] == pytest.approx(sum(rewards[-5:]) / 5)
    assert "rewards/task" in result.metrics  # the summary shows each reward component
    manifest = json.loads((run / "final" / "manifest.json").read_text())
    assert manifest["kind"] == "model" and manifest["parent"] == str(tiny_model.resolve())
    assert [ref["kind"] for ref in manifest["inputs"]] == ["documents", "model"]


@pytest.mark.slow
def test_grpo_mean_reward_rises_on_a_learnable_toy_reward(tiny_model, tmp_path):
    recipe = load_command_recipe("grpo", toy_recipe(tmp_path, algorithm="grpo"), ["logging.completions_interval=7"])
    result = run_grpo(recipe, tmp_path / "run", start=str(tiny_model))
    rewards = rewards_logged(tmp_path / "run")
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, f"grpo did not learn: {first:.3f} → {last:.3f} ({rewards})"
    check_finished_run(tmp_path / "run", result, tiny_model, {7, 14})


def test_nan_rewards_are_counted_and_skipped(tiny_model, tmp_path):
    path = toy_recipe(tmp_path, reward="test_ppo:nan_reward")
    recipe = load_command_recipe(
        "ppo", path, ["training.steps=2", "ppo.epochs=1", "ppo.max_new_tokens=4", "logging.completions_interval=2"]
    )
    result = run_ppo(recipe, tmp_path / "run", start=str(tiny_model))
    assert result.metrics["nan_rewards_skipped"] > 0
    assert all(math.isfinite(r) for r in rewards_logged(tmp_path / "run"))
    lines = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert lines and {line["step"] for line in lines} == {2}  # every completions_interval steps
    assert all(line["total"] == 1.0 and "x" not in line["completion"] for line in lines)  # NaN ones left out
    assert set(lines[0]) == {"step", "prompt", "completion", "rewards", "total", "advantage"}
    assert lines[0]["rewards"] == {"task": 1.0} and math.isfinite(lines[0]["advantage"])


def test_ppo_resumes_from_its_newest_checkpoint(tiny_model, tmp_path):
    path = toy_recipe(tmp_path)
    short = ["training.steps=2", "checkpoint.interval=1", "ppo.epochs=1", "ppo.max_new_tokens=4"]
    run_ppo(load_command_recipe("ppo", path, short), tmp_path / "run", start=str(tiny_model))
    with pytest.raises(UserError, match="already holds a run — pass --resume auto to continue it"):
        run_ppo(load_command_recipe("ppo", path, short), tmp_path / "run", start=str(tiny_model))
    longer = load_command_recipe("ppo", path, [*short, "training.steps=3"])
    result = run_ppo(longer, tmp_path / "run", start=str(tiny_model), resume="auto")
    assert result.resumed_from.endswith("step-0000002") and result.steps == 3
    steps = [r["step"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())]
    assert steps == [1, 2, 3]


def test_bad_ppo_inputs_fail_before_training(tiny_model, tmp_path):
    path = toy_recipe(tmp_path)
    broken = toy_recipe(tmp_path, reward="nowhere_module:score")
    with pytest.raises(UserError, match="cannot import module 'nowhere_module'"):
        run_ppo(load_command_recipe("ppo", broken), tmp_path / "a", start=str(tiny_model))
    exact = toy_recipe(tmp_path, match="exact")
    with pytest.raises(
        UserError, match=r"has no column 'answer' for the task reward \(columns: id, prompt, reference\)"
    ):
        run_ppo(
            load_command_recipe("ppo", exact, ["data.reference_column=answer"]), tmp_path / "b", start=str(tiny_model)
        )
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match=r"grpo\.use_vllm: vLLM generation needs a GPU"):
            run_grpo(
                load_command_recipe("grpo", toy_recipe(tmp_path, algorithm="grpo"), ["grpo.use_vllm=true"]),
                tmp_path / "e",
                start=str(tiny_model),
            )
    with pytest.raises(UserError, match=r"not a multiple of grpo\.num_generations"):
        run_grpo(
            load_command_recipe("grpo", toy_recipe(tmp_path, algorithm="grpo"), ["grpo.num_generations=3"]),
            tmp_path / "c",
            start=str(tiny_model),
        )
    with pytest.raises(UserError, match=r"rewards\[0\]\.kind: must be .task., .length., .diversity. or .model."):
        load_command_recipe("ppo", toy_recipe(tmp_path, kind="taks"))
    with pytest.raises(UserError, match=r"--resume: .* is not a complete checkpoint \(no trainer_state.json\)"):
        run_ppo(load_command_recipe("ppo", path), tmp_path / "d", start=str(tiny_model), resume=str(tmp_path))
    assert not any((tmp_path / name).exists() for name in "abe")


# ---------------------------------------------------------------------------------------------------------------
# A reward that depends on the position of a token, and PPO on several processes

FIRST_TOKEN_STARTS_A_WORD = ["[[rewards]]", 'kind = "task"', 'match = "regex"', 'pattern = "^ "']
"""1 when the completion's first token begins a word (~0.37 for the random tiny model), whatever comes after:
only the first token's log-probability can earn it, so advantages credited to the wrong position (shifted by one
token) leave the reward flat."""


def position_recipe(tmp_path, *lines: str) -> str:
    path = tmp_path / "first-token.toml"
    path.write_text(
        "\n".join(
            [
                "[data]",
                'path = "data/sample/prompts"',
                "[optimizer]",
                "weight_decay = 0.0",
                "[schedule]",
                'kind = "constant"',
                "[training]",
                "micro_batch = 16",
                "[logging]",
                "interval = 1",
                "[ppo]",
                "kl_coef = 0.0",
                "ent_coef = 0.0",
                "max_new_tokens = 3",
                *lines,
                *FIRST_TOKEN_STARTS_A_WORD,
            ]
        )
        + "\n"
    )
    return str(path)


def metrics_logged(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_reward_for_the_first_token_rises(tiny_model, tmp_path):
    """Seeded (sampling and minibatch order), so the same every run: the mean reward of the last 3 steps is 0.93
    against 0.36 for the first 3. Broken once by hand to check the margin: whitened advantages shifted one token
    later (the first token then earns nothing) end at 0.48 (+0.12), negated ones (GAE with the wrong sign) at
    0.00."""
    path = position_recipe(tmp_path, "batch_size = 32", "minibatch_size = 16", "epochs = 4")
    recipe = load_command_recipe(
        "ppo",
        path,
        ["optimizer.lr=1e-2", "training.steps=12", "checkpoint.interval=100", "logging.completions_interval=6"],
    )
    result = run_ppo(recipe, tmp_path / "run", start=str(tiny_model))
    rewards = rewards_logged(tmp_path / "run")
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert first < 0.5 and last > first + 0.35, f"{first:.3f} → {last:.3f} ({rewards})"
    check_finished_run(tmp_path / "run", result, tiny_model, {6, 12})


COMPARED = (
    "reward",
    "completion_length",
    "kl",
    "policy_loss",
    "value_loss",
    "entropy",
    "clipfrac",
    "grad_norm",
    "explained_variance",
)


@pytest.mark.slow
def test_two_processes_make_the_updates_of_one_and_resume_on_one(tiny_model, tmp_path):
    """Two CPU processes under torchrun (gloo, DDP), each with half of every batch, against one process with the
    same batch: the same sampled completions (each generate call samples from the seed of its place in the batch)
    and the same statistics and updates step by step, the KL penalty and a critic-warmup step included. Only float
    rounding differs (gradients averaged by an all-reduce instead of summed over micro batches, sums taken in
    another order): measured differences are ~1e-6 relative, while a per-rank whitening or a gradient not scaled
    by the world size shifts the losses by several percent. The 2-process step-2 checkpoint then resumes on one
    process and makes the one-process step 3."""
    recipe = position_recipe(
        tmp_path, "batch_size = 8", "minibatch_size = 8", "epochs = 2", "critic_warmup_steps = 1", "critic_lr = 1e-3"
    )
    overrides = [
        "optimizer.lr=1e-2",
        "training.steps=3",
        "training.micro_batch=2",
        "ppo.kl_coef=0.1",
        "checkpoint.interval=2",
        "checkpoint.keep=2",
        "logging.completions_interval=1",
    ]
    one = load_command_recipe("ppo", recipe, [*overrides, "ppo.generation_micro_batch=4"])
    run_ppo(one, tmp_path / "one", start=str(tiny_model))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "smolctl",
        "ppo",
        recipe,
        str(tmp_path / "two"),
        "--from",
        str(tiny_model),
        "--json",
        *(f"--set={o}" for o in overrides),
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1 and reports[0]["steps"] == 3  # rank 0 reports, once

    alone, shared = metrics_logged(tmp_path / "one"), metrics_logged(tmp_path / "two")
    assert [r["step"] for r in shared] == [1, 2, 3] and shared[0]["critic_warmup"] == 1.0
    assert "policy_loss" in shared[1] and shared[2]["kl"] != 0.0
    for a, b in zip(alone, shared):
        for key in COMPARED:
            assert (key in a) == (key in b)
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (b["step"], key, a[key], b[key])
    texts = [
        [(line["prompt"], line["completion"]) for line in map(json.loads, (run / "completions.jsonl").open())]
        for run in (tmp_path / "one", tmp_path / "two")
    ]
    assert len(texts[1]) == 3 * 8 and texts[0] == texts[1]  # every rank's completions, in batch order
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "final").num_parameters() > 0

    resumed = run_ppo(
        one, tmp_path / "resumed", start=str(tiny_model), resume=str(tmp_path / "two" / "checkpoints" / "step-0000002")
    )
    assert resumed.steps == 3
    last = metrics_logged(tmp_path / "resumed")[-1]
    assert last["step"] == 3 and all(
        last[key] == pytest.approx(alone[2][key], rel=1e-4, abs=1e-6) for key in COMPARED if key in alone[2]
    )
