"""Close the demo: a table of every stage (inputs, outputs, counts, time) and a sample from the final model.

Reads OUT/stages.tsv (stage, output folder, seconds) written by scripts/demo.sh and each output's manifest.
"""

from __future__ import annotations

import sys
from pathlib import Path

from smolctl.console import console, human_count, show, table
from smolctl.shards import read_manifest


def describe(output: Path) -> tuple[str, str, str]:
    manifest = read_manifest(output) if output.is_dir() else None
    if manifest is None:
        return "-", "-", "-"
    inputs = ", ".join(Path(ref["path"]).name for ref in manifest.get("inputs", [])) or "-"
    counts = []
    if manifest.get("rows"):
        counts.append(f"{human_count(manifest['rows'])} rows")
    if manifest.get("tokens"):
        counts.append(f"{human_count(manifest['tokens'])} tokens")
    for key in ("kept", "documents", "steps", "final_loss", "vocab_size", "mean_reward"):
        value = (manifest.get("stats") or {}).get(key)
        if value is not None:
            counts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    return manifest["kind"], inputs, "; ".join(counts) or "-"


def sample_generation(model_dir: Path, prompt: str) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    messages = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=40, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def main(out: Path, final_model: str | None) -> None:
    rows = []
    total = 0.0
    for line in (out / "stages.tsv").read_text().splitlines():
        stage, output, seconds = line.split("\t")
        total += float(seconds)
        kind, inputs, counts = describe(Path(output))
        rows.append((stage, inputs, output, kind, counts, f"{float(seconds):.1f}s"))
    rows.append(("total", "", "", "", "", f"{total:.1f}s"))
    show(table("smolctl demo: every stage", ["stage", "inputs", "output", "kind", "counts", "time"], rows, justify="left"))
    if final_model:
        prompt = "What does `json.dumps` do?"
        console.print(f"[bold]sample from {final_model}[/]\n  user: {prompt}\n  assistant: {sample_generation(Path(final_model), prompt)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
