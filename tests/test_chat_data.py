"""Post-training rows in the shapes hub datasets store them: what each becomes for TRL, and what is refused.

Each refused shape used to fail inside TRL as an internal error after the run folder was made, or to train on the
wrong thing with exit 0 (a repeated user turn scored as the answer, a tool call trained as an empty reply)."""

from __future__ import annotations

import re

import datasets
import pytest
from conftest import SAMPLE

from smolctl.train.chat_data import BadRow, conversation, preference_row, reference_text, sft_row
from smolctl.train.config import RewardSection
from smolctl.train.posttrain import untrained_examples
from smolctl.train.rewards import CompositeReward

USER, ASSISTANT = {"role": "user", "content": "what is 2+2?"}, {"role": "assistant", "content": "4"}


def test_text_parts_are_joined_and_other_parts_refused():
    parts = [{"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "text", "text": "2+2?"}]}]
    assert conversation(parts + [ASSISTANT], "messages", False) == [USER, ASSISTANT]
    image = [{"role": "user", "content": [{"type": "image", "image": None}, {"type": "text", "text": "what?"}]}]
    with pytest.raises(BadRow, match="column 'messages' turn 0 holds a 'image' part"):
        conversation(image, "messages", False)


def test_arrow_s_absent_keys_are_dropped_and_a_turn_needs_content():
    # Arrow gives every turn every key of the column's struct: a None tool_calls must not reach the template.
    assert conversation([USER | {"tool_calls": None}, ASSISTANT | {"name": None}], "messages", False) == [
        USER,
        ASSISTANT,
    ]
    for content, said in ((None, "null"), ("", "empty")):
        with pytest.raises(BadRow, match=f"turn 1 \\(assistant\\) is {said}"):
            conversation([USER, {"role": "assistant", "content": content}], "messages", False)
    assert conversation([{"role": "system", "content": ""}, USER], "messages", False)[0]["content"] == ""


def test_tool_calls_are_kept_only_where_the_template_renders_them():
    call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "add", "arguments": "{}"}}]}
    with pytest.raises(BadRow, match="turn 1 holds tool calls, which the model's chat template does not render"):
        conversation([USER, call], "messages", False)
    kept = conversation([USER, call], "messages", True)
    assert kept[1]["tool_calls"] == call["tool_calls"] and kept[1]["content"] == ""


@pytest.mark.parametrize(
    "value, said",
    [
        ('[{"role": "user", "content": "hi"}]', "holds text, not a list of turns"),
        ([{"from": "human", "value": "hi"}], "turn 0 is a ShareGPT turn"),
        (["hi"], "turn 0 is str, not a {role, content} turn"),
    ],
)
def test_shapes_trl_cannot_take_are_named(value, said):
    with pytest.raises(BadRow, match=said):
        conversation(value, "messages", False)


def test_a_conversation_stored_as_json_text_is_refused_wherever_text_is_taken():
    """Taken as text, the JSON trained as the words, and the prompt chosen and rejected share ended mid-JSON."""
    import json

    chat = json.dumps([USER, ASSISTANT])
    said = "column 'chosen' holds a conversation as JSON text"
    for as_chat in (False, True):
        with pytest.raises(BadRow, match=said):
            preference_row(
                {"chosen": chat, "rejected": json.dumps([USER, ASSISTANT | {"content": "5"}])}, as_chat, False
            )
        with pytest.raises(BadRow, match="column 'prompt' holds a conversation as JSON text"):
            sft_row({"prompt": json.dumps([USER]), "completion": "4"}, ["prompt", "completion"], as_chat, False)
    # JSON that is not a conversation is text like any other, "role" and "from" keys included
    for text in ('[{"from": "JFK", "to": "LAX"}]', '[{"name": "Ann", "role": "CTO"}]'):
        assert sft_row({"prompt": "as JSON", "completion": text}, ["prompt", "completion"], False, False)
    with pytest.raises(BadRow, match="holds a conversation as JSON text"):
        sft_row({"prompt": " \r\n[ {" + chat[2:], "completion": "4"}, ["prompt", "completion"], False, False)
    for turns in (
        [{"role": "prompter", "content": "hi"}, {"role": "assistant", "content": "yo"}],  # OpenAssistant
        [{"role": "User", "content": "hi"}],
        [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}, {"role": "ipython", "content": "1"}],
        [{"from": "human", "text": "hi"}],
    ):
        with pytest.raises(BadRow, match="holds a conversation as JSON text"):
            sft_row({"prompt": "q", "completion": json.dumps(turns)}, ["prompt", "completion"], False, False)
    assert sft_row({"prompt": '[{"a": 1}] parse this', "completion": "ok"}, ["prompt", "completion"], False, False)
    assert (
        sft_row({"prompt": "[1, 2]", "completion": "3"}, ["prompt", "completion"], False, False)["prompt"] == "[1, 2]"
    )


def test_a_conversational_prompt_takes_a_plain_completion_as_the_assistant_turn():
    row = sft_row({"prompt": [USER], "completion": "4"}, ["prompt", "completion"], False, False)
    assert row == {"prompt": [USER], "completion": [ASSISTANT]}
    assert sft_row({"prompt": "hi", "completion": "4"}, ["prompt", "completion"], False, False) == {
        "prompt": "hi",
        "completion": "4",
    }
    with pytest.raises(BadRow, match="column 'completion' holds a 'user' turn after the prompt"):
        sft_row({"prompt": [USER], "completion": [USER, ASSISTANT]}, ["prompt", "completion"], True, False)


def test_ultrafeedback_s_chosen_and_rejected_repeat_the_prompt_and_are_cut_to_the_answer():
    wrong = {"role": "assistant", "content": "5"}
    row = {"prompt": "what is 2+2?", "chosen": [USER, ASSISTANT], "rejected": [USER, wrong]}
    assert preference_row(row, True, False) == {"prompt": [USER], "chosen": [ASSISTANT], "rejected": [wrong]}


def test_without_a_prompt_column_the_prompt_is_what_chosen_and_rejected_share():
    wrong = {"role": "assistant", "content": "5"}
    system = {"role": "system", "content": "be brief"}
    row = {"chosen": [system, USER, ASSISTANT], "rejected": [system, USER, wrong]}
    assert preference_row(row, True, False) == {"prompt": [system, USER], "chosen": [ASSISTANT], "rejected": [wrong]}
    text = {"chosen": "\n\nHuman: 2+2?\n\nAssistant: 4", "rejected": "\n\nHuman: 2+2?\n\nAssistant: 5"}  # HH-RLHF
    assert preference_row(text, False, False) == {
        "prompt": "\n\nHuman: 2+2?\n\nAssistant:",
        "chosen": " 4",
        "rejected": " 5",
    }
    # cut before the word the answers differ in, never inside it ("is bl" + "ue."), nor inside a shorter answer
    for chosen, rejected, prompt in (
        ("Sky? The sky is blue.", "Sky? The sky is black.", "Sky? The sky is"),
        ("Hi? Hello", "Hi? Hello there", "Hi?"),
        ("Hi? Hello", "Hi? Hello", "Hi?"),  # identical: kept, and counted as an identical pair
        ("天空是蓝色的", "天空是黑色的", "天空是"),  # no spaces to cut at
        ("Human: 2+2?\nAssistant:4", "Human: 2+2?\nAssistant:5", "Human: 2+2?\nAssistant:"),  # no space after it
        ("Q: 天空是什么颜色？答：天空是蓝色的", "Q: 天空是什么颜色？答：天空是黑色的", "Q: 天空是什么颜色？答："),
        ("天空是蓝色的", "天空是蓝色的", "天空是蓝色"),  # identical, with no boundary at all
        ("प्रश्न: किताब", "प्रश्न: कितना", "प्रश्न:"),  # a vowel sign is a mark, not a letter, and inside the word
    ):
        cut = preference_row({"chosen": chosen, "rejected": rejected}, False, False)
        assert (cut["prompt"], cut["prompt"] + cut["chosen"], cut["prompt"] + cut["rejected"]) == (
            prompt,
            chosen,
            rejected,
        )
    with pytest.raises(BadRow, match="share no text to take as the prompt"):
        preference_row({"chosen": " A", "rejected": " B"}, False, False)  # a space is no prompt
    same = preference_row({"chosen": [system, USER, ASSISTANT], "rejected": [system, USER, ASSISTANT]}, True, False)
    assert same == {"prompt": [system, USER], "chosen": [ASSISTANT], "rejected": [ASSISTANT]}
    with pytest.raises(BadRow, match="share no prompt turns"):
        preference_row({"chosen": [ASSISTANT], "rejected": [wrong]}, True, False)


def test_a_user_turn_in_the_answer_is_refused():
    row = {"prompt": "what is 2+2?", "chosen": [{"role": "user", "content": "what?"}], "rejected": [ASSISTANT]}
    with pytest.raises(BadRow, match="column 'chosen' holds a 'user' turn after the prompt"):
        preference_row(row, True, False)


def test_references_become_texts_and_a_list_matches_any_of_them():
    assert reference_text(4, "answer") == "4" and reference_text([4, "four"], "answer") == ["4", "four"]
    # pandas stores an integer column holding a null as float64: 72.0 is the answer "72", 0.5 stays itself
    assert reference_text(72.0, "answer") == "72" and reference_text([72.0, 0.5], "answer") == ["72", "0.5"]
    for bad, said in ((None, "is null"), (True, "is a boolean"), ({"a": 1}, "is dict"), ([], "holds a list")):
        with pytest.raises(BadRow, match=said):
            reference_text(bad, "answer")
    for match in ("exact", "regex"):
        reward = CompositeReward([RewardSection(kind="task", match=match)])
        scores = reward.score(["4", "the answer is four", "5"], [1, 4, 1], [["4", "four"]] * 3).totals
        assert scores == ([1.0, 0.0, 0.0] if match == "exact" else [1.0, 1.0, 0.0])


def test_untrained_examples_are_counted_per_packed_span():
    """Two packed rows holding three examples; the second example's labels are all ignored (its assistant turns
    fell past max_length), as is the whole unpacked row of the second table."""
    packed = datasets.Dataset.from_dict(
        {
            "input_ids": [[1, 2, 3, 4, 5], [6, 7]],
            "labels": [[-100, 2, -100, -100, -100], [-100, 7]],
            "seq_lengths": [[2, 3], [2]],
        }
    )
    assert untrained_examples(packed) == (3, 1)
    masks = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, 4]], "assistant_masks": [[0, 1], [0, 0]]})
    assert untrained_examples(masks) == (2, 1)
    assert untrained_examples(masks.select([1])) == (1, 1) and untrained_examples(
        masks.filter(lambda r: r["input_ids"][0] == 1)
    ) == (1, 0)
    assert untrained_examples(datasets.Dataset.from_dict({"input_ids": [[1, 2]]})) == (1, 0)


def test_completions_generate_cut_off_at_max_new_tokens_are_not_trained_on(tokenizer_dir, tmp_path):
    """`generate` marks them finish_reason "length": as SFT targets they taught the model to stop mid-answer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from smolctl.data.tokenizer import load_tokenizer
    from smolctl.errors import UserError
    from smolctl.shards import open_documents
    from smolctl.train.config import ChatDataSection
    from smolctl.train.posttrain import load_sft_dataset

    tokenizer = load_tokenizer(tokenizer_dir)
    reasons = ["stop", "length", "stop"]
    rows = {"prompt": ["a?", "b?", "c?"], "completion": ["A", "B, and so", "C"], "finish_reason": reasons}
    pq.write_table(pa.table(rows), tmp_path / "completions.parquet")
    dataset, stats = load_sft_dataset(
        open_documents(tmp_path / "completions.parquet"), ChatDataSection(path="x"), 0, tokenizer
    )
    assert [row["completion"][0]["content"] for row in dataset] == ["A", "C"]
    assert stats["rows"] == 3 and stats["rows_used"] == 2 and stats["cut_off_completions_dropped"] == 1
    pq.write_table(pa.table(rows | {"finish_reason": ["length"] * 3}), tmp_path / "cut.parquet")
    with pytest.raises(UserError, match="every completion was cut off at its max_new_tokens"):
        load_sft_dataset(open_documents(tmp_path / "cut.parquet"), ChatDataSection(path="x"), 0, tokenizer)


def test_a_tool_calling_turn_adds_no_keys_to_the_other_turns(tmp_path):
    """Inferred Arrow structs gave every turn of every row `tool_calls: None`; a template testing
    `'tool_calls' in message` (as Llama 3.1's does) then took len(None) on the plain rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers.utils.chat_template_utils import render_jinja_template

    from smolctl.shards import open_documents
    from smolctl.train.config import ChatDataSection
    from smolctl.train.posttrain import load_sft_dataset

    class Tokenizer:
        chat_template = (
            "{% for m in messages %}{% if 'tool_calls' in m %}[{{ m.tool_calls | length }} call]"
            "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
        )

    call = [{"type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]
    rows = [
        {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": call}, ASSISTANT]},
        {"messages": [USER, ASSISTANT]},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "tools.parquet")
    dataset, _ = load_sft_dataset(open_documents(tmp_path / "tools.parquet"), ChatDataSection(path="x"), 0, Tokenizer)
    assert dataset[1]["messages"] == [USER, ASSISTANT]
    assert dataset[0]["messages"][1]["tool_calls"] == call
    rendered, _ = render_jinja_template(conversations=[dataset[1]["messages"]], chat_template=Tokenizer.chat_template)
    assert rendered[0] == "user: what is 2+2?\nassistant: 4\n"


def test_identical_pairs_are_counted_among_the_rows_used(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from smolctl.errors import UserError
    from smolctl.shards import open_documents
    from smolctl.train.config import PreferenceDataSection
    from smolctl.train.posttrain import load_preference_dataset

    class Plain:
        chat_template = None

    rows = {"prompt": ["a?", "b?", "c?"], "chosen": ["A", "B", "C"], "rejected": ["no", "B", "C"]}
    pq.write_table(pa.table(rows), tmp_path / "pairs.parquet")
    source = open_documents(tmp_path / "pairs.parquet")
    dataset, stats = load_preference_dataset(source, PreferenceDataSection(path="x", limit=2), Plain)
    assert (stats["rows"], stats["rows_used"], stats["identical_pairs"]) == (3, 2, 1)
    assert dataset["rejected"] == ["no", "B"] and stats["format"] == "text"
    pq.write_table(pa.table(rows | {"rejected": ["A", "B", "C"]}), tmp_path / "same.parquet")
    with pytest.raises(UserError, match="chosen equals rejected in every pair"):
        load_preference_dataset(open_documents(tmp_path / "same.parquet"), PreferenceDataSection(path="x"), Plain)


def test_plain_conversations_are_taken_as_they_are_and_the_rest_row_by_row(tmp_path):
    """Batches of role/content text turns skip the Python conversion: what they give must equal the row-by-row
    result, and a batch holding one bad row must still name it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from smolctl.errors import UserError
    from smolctl.shards import open_documents
    from smolctl.train.chat_data import checked_rows, plain_conversations
    from smolctl.train.config import ChatDataSection
    from smolctl.train.posttrain import load_sft_dataset

    class Chat:
        chat_template = "{{ messages }}"

    source = open_documents(SAMPLE / "chat")
    batches = [b for i in range(len(source.files)) for b in source.iter_file_batches(i, ["messages"])]
    assert all(plain_conversations(b, "messages") for b in batches)
    dataset, _ = load_sft_dataset(source, ChatDataSection(path="x"), 0, Chat)
    slow = checked_rows(source, ["messages"], lambda row: sft_row(row, ["messages"], True, False))
    assert dataset.to_list() == slow and len(slow) == source.num_rows

    system = {"role": "system", "content": ""}
    good = [system, USER, ASSISTANT]
    for bad, said in (
        ([USER, {"role": "assistant", "content": ""}], "row 2 (from 0): column 'messages' turn 1 (assistant) is empty"),
        ([], "row 2 (from 0): column 'messages' holds no turns"),
    ):
        pq.write_table(pa.table({"messages": [good, good, bad]}), tmp_path / "chat.parquet")
        assert not plain_conversations(pa.table({"messages": [good, bad]}).to_batches()[0], "messages")
        with pytest.raises(UserError, match=re.escape(said)):
            load_sft_dataset(open_documents(tmp_path / "chat.parquet"), ChatDataSection(path="x"), 0, Chat)


def test_turns_with_uneven_keys_keep_them_beside_plain_columns():
    """GRPO's prompts beside its int `row` column: the JSON path built the int column's feature from an Arrow
    type object, and failed."""
    import pyarrow as pa

    from smolctl.train.chat_data import as_dataset

    rows = [
        {"prompt": [{"role": "user", "content": "hi", "name": "ann"}], "row": 0},
        {"prompt": [{"role": "user", "content": "yo"}], "row": 1},
    ]
    dataset = as_dataset(pa.Table.from_pylist(rows))
    assert dataset.to_list() == rows and dataset.features["row"].dtype == "int64"


def test_a_category_column_merges_across_arrow_and_row_by_row_batches(tmp_path):
    """pandas stores a category dictionary-encoded; a batch kept as read held it so, one gone row by row held
    plain text, and the two did not merge."""
    import pandas as pd

    from smolctl.shards import open_documents
    from smolctl.train.config import ChatDataSection
    from smolctl.train.posttrain import load_sft_dataset

    class Chat:
        chat_template = "{{ messages }}"

    system = {"role": "system", "content": None}  # accepted, but not by the Arrow check: row by row
    for name, first in (("a", []), ("b", [system])):
        frame = pd.DataFrame(
            {
                "messages": [first + [USER, ASSISTANT]] * 4,
                "task": pd.Categorical(["math", "chat"] * 2),
            }
        )
        frame.to_parquet(tmp_path / f"{name}.parquet")
    dataset, stats = load_sft_dataset(open_documents(tmp_path), ChatDataSection(path="x", balance_by="task"), 0, Chat)
    assert stats["groups_before"] == {"math": 4, "chat": 4} and len(dataset) == 8
