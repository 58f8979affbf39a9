"""Post-training rows as TRL trains on them, from the shapes hub datasets store them in, checked row by row before
the run folder is made: a row TRL cannot take failed deep in its data preparation as an internal error, and some
shapes trained on the wrong thing without a word.

- A turn's content may be a string or a list of parts (`[{"type": "text", "text": ...}]`, as datasets made for
  multimodal models store it): text parts are joined, any other part is refused (these models read text).
- A turn without content is refused, but for an assistant turn holding tool calls, which is kept only when the
  tokenizer's chat template renders tool calls (else it would train as an empty reply).
- ShareGPT turns (`from`/`value`) and conversations stored as JSON text are refused with the fix.
- Preference rows: chosen/rejected conversations that repeat the prompt's turns (UltraFeedback's layout) are cut
  to the answer, and without a prompt column the prompt is the turns (or text) chosen and rejected share, as TRL
  extracts an implicit prompt. What is left of chosen and rejected must be the answer alone.
- References for rewards: numbers become text (GSM8K stores answers as integers), a list is any of its texts.
"""

from __future__ import annotations

import json
import re
import unicodedata
import uuid
from collections.abc import Iterator

import pyarrow as pa

from smolctl.errors import UserError
from smolctl.shards import DocumentSource


class BadRow(ValueError):
    """What is wrong with one row, and what to do; the caller names the file and the row."""

    def __init__(self, what: str, fix: str = "fix or drop that row"):
        super().__init__(what)
        self.what, self.fix = what, fix


def checked_batches(source: DocumentSource, columns: list[str], prepare, accept=None) -> Iterator[list | pa.Table]:
    """`prepare(row)` of every row, a list per batch read; the first BadRow is one UserError naming its file and
    row. A batch `accept(batch)` vouches for (every row already as `prepare` would return it) comes as its Arrow
    table instead, unconverted."""
    for index, path in enumerate(source.files):
        row = 0
        for batch in source.iter_file_batches(index, columns):
            if accept is not None and accept(batch):
                # as to_pylist gives them: a dictionary-encoded column (a pandas category) decoded, or the
                # row-by-row batches' plain values would not merge with it
                yield pa.Table.from_batches([batch]).cast(_decoded(batch.schema))
                row += batch.num_rows
                continue
            prepared = []
            for values in batch.to_pylist():
                try:
                    prepared.append(prepare(values))
                except BadRow as bad:
                    raise UserError(path, f"row {row} (from 0): {bad.what}", bad.fix) from None
                row += 1
            yield prepared


def _decoded(schema: pa.Schema) -> pa.Schema:
    return pa.schema(
        [f.with_type(f.type.value_type) if pa.types.is_dictionary(f.type) else f for f in schema],
        metadata=schema.metadata,
    )


def checked_rows(source: DocumentSource, columns: list[str], prepare) -> list:
    """`prepare(row)` of every row, as `checked_batches` checks them."""
    return [row for batch in checked_batches(source, columns, prepare) for row in batch]


def checked_table(source: DocumentSource, columns: list[str], prepare, accept=None) -> tuple[pa.Table | None, int]:
    """(the rows `prepare` returns, but None, as one Arrow table; the rows read). Each batch becomes Arrow as it
    is read: Python dicts of a whole dataset took ~5 KB a conversation, several times its Arrow size."""
    tables, read = [], 0
    for batch in checked_batches(source, columns, prepare, accept):
        if isinstance(batch, pa.Table):
            read += batch.num_rows
            tables.append(batch)
            continue
        read += len(batch)
        kept = [row for row in batch if row is not None]
        if kept:
            tables.append(pa.Table.from_pylist(kept))
    # permissive: a batch whose turns carry keys the others lack (tool_calls) widens the struct for all
    return (pa.concat_tables(tables, promote_options="permissive") if tables else None), read


def plain_conversations(batch: pa.RecordBatch, column: str) -> bool:
    """Whether every row of the column is already what `conversation` returns for it, checked on the Arrow
    arrays: a non-empty list of role/content turns, all text, every content there and only a system turn's
    empty. The common case costs a few array passes instead of a Python dict per turn; any other batch goes
    row by row, for the exact error."""
    import pyarrow.compute as pc

    values = batch.column(column)
    turns_type = values.type.value_type if is_list(values.type) else None
    if turns_type is None or not pa.types.is_struct(turns_type) or values.null_count:
        return False
    if {turns_type.field(i).name for i in range(turns_type.num_fields)} != {"role", "content"}:
        return False
    if not all(_is_text(turns_type.field(name).type) for name in ("role", "content")):
        return False
    if len(values) and pc.min(pc.list_value_length(values)).as_py() == 0:
        return False
    turns = pc.list_flatten(values)
    role, content = pc.struct_field(turns, "role"), pc.struct_field(turns, "content")
    if role.null_count or content.null_count or turns.null_count:
        return False
    empty_reply = pc.and_(pc.equal(pc.binary_length(content), 0), pc.not_equal(role, "system"))
    return not pc.any(empty_reply).as_py()


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def as_dataset(table: pa.Table):
    """The rows as a `datasets.Dataset` that gives each turn back as it was. Arrow structs give every turn the
    keys of all turns, so one tool-calling turn added `tool_calls: None` to every plain turn of every row, which
    templates testing `'tool_calls' in message` (Llama 3.1's) fail on: where a column's turns lack keys others
    have (a null field: prepared turns hold no None), or hold more than text, its turns are stored as JSON, each
    with its own keys. Otherwise the table is exact, and much faster and smaller to train from."""
    import datasets

    uneven = [field.name for field in table.schema if is_list(field.type) and not _text_turns(table.column(field.name))]
    if not uneven:
        # A fingerprint given: datasets would otherwise pickle the whole table to hash it (2 GB and 2.4 s for 200k
        # conversations); it names map() caches, which an in-memory dataset never writes.
        return datasets.Dataset(table, fingerprint=uuid.uuid4().hex)
    rows = table.to_pylist()
    for row in rows:
        for column in uneven:
            row[column] = [{key: value for key, value in turn.items() if value is not None} for turn in row[column]]
    plain = datasets.Features.from_arrow_schema(pa.schema([f for f in table.schema if not is_list(f.type)]))
    features = datasets.Features(
        {
            field.name: datasets.List(datasets.Json()) if is_list(field.type) else plain[field.name]
            for field in table.schema
        }
    )
    return datasets.Dataset.from_list(rows, features=features)


def is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind)


def _text_turns(column: pa.ChunkedArray) -> bool:
    """Whether every turn of the column holds every key, each as text."""
    import pyarrow.compute as pc

    turns = pc.list_flatten(column)
    if not pa.types.is_struct(turns.type):
        return False
    fields = [turns.type.field(i) for i in range(turns.type.num_fields)]
    return all(
        pa.types.is_string(field.type) and pc.struct_field(turns, [i]).null_count == 0 for i, field in enumerate(fields)
    )


def renders_tool_calls(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tool_calls" in (template if isinstance(template, str) else str(template))


def conversation(value, column: str, tool_calls_rendered: bool) -> list[dict]:
    """A column's list of turns, each with its content as one string (see the module's docstring)."""
    if isinstance(value, str):
        raise BadRow(
            f"column '{column}' holds text, not a list of turns",
            "store each conversation as a list of {role, content} (json.loads it before writing the parquet)",
        )
    turns = []
    for number, turn in enumerate(value):
        where = f"column '{column}' turn {number}"
        if not isinstance(turn, dict):
            raise BadRow(f"{where} is {type(turn).__name__}, not a {{role, content}} turn")
        if turn.get("role") is None and turn.get("from") is not None:
            raise BadRow(
                f"{where} is a ShareGPT turn (from/value)",
                "rename the turn keys to role/content and the roles human/gpt to user/assistant",
            )
        role, content, tool_calls = turn.get("role"), _text(turn.get("content"), where), turn.get("tool_calls")
        if tool_calls and not tool_calls_rendered:
            raise BadRow(
                f"{where} holds tool calls, which the model's chat template does not render (it would train as an "
                "empty reply)",
                "drop the rows with tool calls, or start from a model whose chat template renders tool_calls",
            )
        if not content and not tool_calls and role != "system":
            raise BadRow(f"{where} ({role}) is {'empty' if content == '' else 'null'}")
        turns.append({key: item for key, item in turn.items() if item is not None} | {"content": content or ""})
    if not turns:
        raise BadRow(f"column '{column}' holds no turns")
    return turns


def _text(content, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise BadRow(f"{where} holds a {kind!r} part", "keep the text parts only: this model reads text")
            texts.append(part["text"])
        return "".join(texts)
    raise BadRow(f"{where} content is {type(content).__name__}, not text")


def plain_text(value: str, column: str) -> str:
    """A text column's value, refused where it is a conversation stored as JSON text: taken as text, its JSON
    would train as the words, and the prompt chosen and rejected share would end mid-JSON."""
    if _JSON_LIST_OF_OBJECTS.match(value):
        try:
            turns = json.loads(value)
        except ValueError:
            return value
        # turns as chat datasets write them, with roles such datasets use: structured output that happens to
        # hold a "role" or "from" key ([{"name": "Ann", "role": "CTO"}], flights) is text like any other
        if isinstance(turns, list) and turns and all(_is_turn(t) for t in turns):
            raise BadRow(
                f"column '{column}' holds a conversation as JSON text",
                "store each conversation as a list of {role, content} (json.loads it before writing the parquet)",
            )
    return value


_JSON_LIST_OF_OBJECTS = re.compile(r"\s*\[\s*\{")
_CHAT_ROLES = {
    *("system", "user", "assistant", "tool", "function", "developer", "ipython"),
    *("human", "gpt", "model", "bot", "prompter", "observation"),
}


def _is_turn(value) -> bool:
    """A chat turn as datasets store them: a role (any case) with content or tool calls, or ShareGPT's from with
    value or text."""
    if not isinstance(value, dict):
        return False
    speaker = value.get("role", value.get("from"))
    if not isinstance(speaker, str) or speaker.lower() not in _CHAT_ROLES:
        return False
    said = ("content", "tool_calls") if "role" in value else ("value", "text")
    return any(key in value for key in said)


def as_turns(value, role: str, column: str, tool_calls_rendered: bool) -> list[dict]:
    """A plain string as one turn of `role`; a list of turns as `conversation` checks it."""
    if isinstance(value, str):
        return [{"role": role, "content": plain_text(value, column)}]
    return conversation(value, column, tool_calls_rendered)


def answer_only(turns: list[dict], column: str) -> list[dict]:
    """What the model says: refuse a user (or system) turn among the answer's turns."""
    if not turns:
        raise BadRow(f"column '{column}' holds nothing after the prompt's turns")
    for number, turn in enumerate(turns):
        if turn["role"] not in ("assistant", "tool"):
            raise BadRow(
                f"column '{column}' holds a {turn['role']!r} turn after the prompt (turn {number} of the answer)",
                "give chosen/rejected as the answer alone, or the whole conversation without a prompt column",
            )
    return turns


def sft_row(row: dict, columns: list[str], as_chat: bool, tool_calls_rendered: bool) -> dict:
    """`messages`, or prompt/completion: as text, or (either one given as turns, or a chat template to train
    the format the model will chat in) as turns."""
    if columns == ["messages"]:
        return {"messages": conversation(row["messages"], "messages", tool_calls_rendered)}
    prompt, completion = row["prompt"], row["completion"]
    if not as_chat and isinstance(prompt, str) and isinstance(completion, str):
        return {"prompt": plain_text(prompt, "prompt"), "completion": plain_text(completion, "completion")}
    return {
        "prompt": as_turns(prompt, "user", "prompt", tool_calls_rendered),
        "completion": answer_only(as_turns(completion, "assistant", "completion", tool_calls_rendered), "completion"),
    }


def preference_row(row: dict, as_chat: bool, tool_calls_rendered: bool) -> dict:
    """prompt/chosen/rejected as DPO takes them: all text, or (turns given, or a chat template) all turns."""
    prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
    if not any(isinstance(v, list) for v in (prompt, chosen, rejected)):
        for column, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            if isinstance(value, str):
                plain_text(value, column)
        if prompt is None:  # the text chosen and rejected share, as TRL extracts it, but cut between words
            shared = _prompt_cut(chosen, rejected)
            prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
            if not prompt.strip():
                raise BadRow(
                    "chosen and rejected share no text to take as the prompt (and there is no prompt column)",
                    "add a prompt column, or give chosen/rejected as whole texts starting with the same prompt",
                )
            if not chosen or not rejected:
                raise BadRow("chosen and rejected differ in nothing but one being longer: no answer to compare")
        if not as_chat:
            return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    chosen = as_turns(chosen, "assistant", "chosen", tool_calls_rendered)
    rejected = as_turns(rejected, "assistant", "rejected", tool_calls_rendered)
    if prompt is None:
        shared = _shared_turns(chosen, rejected)
        if shared == 0:
            raise BadRow(
                "chosen and rejected share no prompt turns (and there is no prompt column)",
                "add a prompt column, or give chosen/rejected as whole conversations starting with the same prompt",
            )
        prompt_turns = chosen[:shared]
    else:
        prompt_turns = as_turns(prompt, "user", "prompt", tool_calls_rendered)
    cut = len(prompt_turns)
    if chosen[:cut] == prompt_turns and rejected[:cut] == prompt_turns:  # the conversations repeat the prompt
        chosen, rejected = chosen[cut:], rejected[cut:]
    return {
        "prompt": prompt_turns,
        "chosen": answer_only(chosen, "chosen"),
        "rejected": answer_only(rejected, "rejected"),
    }


def _shared_turns(a: list[dict], b: list[dict]) -> int:
    shared = 0
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    if shared == len(a) == len(b):  # the same conversation: its last reply is the (identical) answer, counted later
        while shared > 0 and a[shared - 1]["role"] in ("assistant", "tool"):
            shared -= 1
    return shared


def _prompt_cut(a: str, b: str) -> int:
    """Where the prompt two texts share ends. Never inside a word: cut at "The sky is bl" + "ue.", prompt and
    answer tokenize into pieces the model never saw in one text. Where that would leave an answer empty (one text
    starts the other, or they are the same), before the last shared word, so both answers hold it. Whitespace at
    the end goes with the answers, as TRL's extract_prompt keeps "Assistant:" in the prompt and " It is blue." in
    the answer. Text with no word boundary before the difference (Chinese, say) is cut where they differ."""
    shared = 0
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    cut = shared
    if cut < min(len(a), len(b)) and cut > 0 and _in_word(a[cut - 1]) and (_in_word(a[cut]) or _in_word(b[cut])):
        while cut > 0 and _in_word(a[cut - 1]):
            cut -= 1
    if cut in (len(a), len(b)):
        while cut > 0 and not a[cut - 1].isspace():
            cut -= 1
    while cut > 0 and a[cut - 1].isspace():
        cut -= 1
    if cut == 0:  # no boundary to cut at: where they differ, leaving each answer a character at least
        cut = min(shared, len(a) - 1, len(b) - 1)
    return max(cut, 0)


def _in_word(char: str) -> bool:
    # letters, digits and combining marks (Devanagari's vowel signs are marks, not letters)
    return char == "_" or unicodedata.category(char)[0] in "LNM"


def _number_text(value: int | float) -> str:
    # An integer column holding a null is stored as float64 (pandas does it): 72.0 must still match "72".
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def reference_text(value, column: str):
    """A reward's reference: text, a number as text, or a list of texts (any of them matches)."""
    if isinstance(value, bool) or value is None:
        raise BadRow(f"column '{column}' is {'null' if value is None else 'a boolean'}, not a reference to match")
    if isinstance(value, (int, float)):
        return _number_text(value)
    if isinstance(value, list):
        if not value or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
            raise BadRow(f"column '{column}' holds a list that is not of texts or numbers")
        return [v if isinstance(v, str) else _number_text(v) for v in value]
    if not isinstance(value, str):
        raise BadRow(f"column '{column}' is {type(value).__name__}, not text")
    return value
