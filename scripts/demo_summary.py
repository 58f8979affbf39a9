"""Close the demo: a table of every stage (inputs, outputs, counts, time) and a sample from the final model.

Reads OUT/stages.tsv (stage, output folder, seconds) written by scripts/demo.sh and each output's manifest.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from smolctl.console import human_count, show, stderr_console, stdout_console, table
from smolctl.shards import read_manifest

# What is worth a glance for each kind of folder, from its manifest's stats.
HIGHLIGHTS = {
    "documents": ("exact_removed", "near_removed"),
    "model": ("steps", "loss", "rewards_accuracies", "rewards_margins", "reward_last"),
    "tokenizer": ("vocab_size", "chars_per_token"),
}


def short(path: str, out: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(out.resolve().parent))
    except ValueError:
        return Path(path).name


def describe(output: Path, out: Path) -> tuple[str, str, str]:
    manifest = read_manifest(output) if output.is_dir() else None
    if manifest is None:
        return "-", "-", "-"
    inputs = ", ".join(short(ref["path"], out) for ref in manifest.get("inputs", [])) or "-"
    counts = []
    if manifest.get("rows"):
        counts.append(f"{human_count(manifest['rows'])} rows")
    if manifest.get("tokens"):
        counts.append(f"{human_count(manifest['tokens'])} tokens")
    stats = manifest.get("stats") or {}
    for key in HIGHLIGHTS.get(manifest["kind"], ()):
        if stats.get(key) is not None:
            value = stats[key]
            counts.append(
                f"{key.replace('_', ' ')} {value:.3g}"
                if isinstance(value, float)
                else f"{key.replace('_', ' ')} {value}"
            )
    return manifest["kind"], inputs, ", ".join(counts) or "-"


def sample_generation(model_dir: Path, prompt: str) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    messages = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=40, do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=3)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def main(out: Path, final_model: str | None) -> None:
    for console in (stdout_console(), stderr_console()):  # the table goes to stdout, the sample to stderr
        console.width = max(console.width, int(os.environ.get("COLUMNS", 0)) or 132)
    rows = []
    total = 0.0
    for line in (out / "stages.tsv").read_text().splitlines():
        stage, output, seconds = line.split("\t")
        total += float(seconds)
        kind, inputs, counts = describe(Path(output), out)
        rows.append(
            (stage, inputs, short(output, out) if output != "-" else "-", kind, counts, f"{float(seconds):.1f}s")
        )
    rows.append(("total", "", "", "", "", f"{total:.1f}s"))
    show(
        table(
            "smolctl demo: every stage", ["stage", "inputs", "output", "kind", "counts", "time"], rows, justify="left"
        )
    )
    if final_model:
        prompt = "What does `json.dumps` do?"
        stderr_console().print(
            f"[bold]sample from {short(final_model, out)}[/] (a 1.5M-parameter model trained for minutes: "
            f"expect babble)\n  user: {prompt}\n  assistant: {sample_generation(Path(final_model), prompt)}"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
