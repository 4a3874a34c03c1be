"""docs/finetuning.md: every command of its ``bash`` blocks marked as run here runs, in order, from a scratch checkout (links to
``examples/``, ``tests/`` and the package), on a tiny Llama with its own subword tokenizer and a jsonl
instruction file written here as ``my-model`` and ``my-data.jsonl``.

The page's main command runs exactly as written (40 steps, 2 CPU ranks) and is the end-to-end check: its
export holds config, safetensors, generation config and tokenizer, loads with ``from_pretrained``, and has
a clearly lower loss on the training responses than the checkpoint it started from. The other commands
get a few steps (``--trainer.max_steps``) unless they set their own. The page's ``python`` blocks marked as
run here (loading the export) run after the commands, as printed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from examples.finetune import TinyLlama, make_pretrained  # noqa: E402
from examples.finetune_assets import sample_rows  # noqa: E402
from examples.sft_data import IGNORE, read_rows, tokenize  # noqa: E402
from test_docs_blocks import blocks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "finetuning.md"
MAIN = ("lightning-zero3 fit --config examples/configs/finetune_full.yaml --model.init_args.checkpoint my-model "
        "--data.init_args.path my-data.jsonl")  # fmt: skip
EXPORT = "runs/finetune-full/export/model"


def page_blocks(lang: str) -> list[str]:
    """The page's blocks of ``lang`` that are marked as run by this test (the others need GPUs or a serving engine)."""
    here = str(Path(__file__).relative_to(ROOT))
    return [b.body for b in blocks(str(PAGE.relative_to(ROOT))) if b.lang == lang and b.run_by == here]


def page_commands() -> list[str]:
    return [line for block in page_blocks("bash") for line in block.splitlines() if line.strip()]


def tiny(command: str) -> str:
    """The command with few steps, if it does not set its own; the main command as written."""
    if command == MAIN or "--trainer.max_steps" in command or not command.startswith("lightning-zero3"):
        return command
    steps = "44" if "--ckpt_path last" in command else "4"  # the resume goes 4 steps past the main run's 40
    return f"{command} --trainer.max_steps {steps} --trainer.limit_val_batches 0"


def lightning_zero3_on_path(tmp: Path) -> dict:
    """This interpreter's environment with ``lightning-zero3`` (the console script's own entry) first on PATH."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    script = bin_dir / "lightning-zero3"
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom lightning_zero3.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PATH": f"{bin_dir}:{env['PATH']}", "PYTHONPATH": f"{ROOT}:{ROOT / 'tests' / 'helpers'}", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def page_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("checkout")
    for name in ("examples", "tests", "lightning_zero3"):
        (work / name).symlink_to(ROOT / name)
    make_pretrained(str(work / "my-model"), TinyLlama(hidden_size=64, intermediate_size=160, num_hidden_layers=3))
    rows = [row for row in sample_rows() if "text" not in row]  # instruction and chat rows
    (work / "my-data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    env = lightning_zero3_on_path(tmp_path_factory.mktemp("tools"))
    logs = {}
    for command in page_commands():
        done = subprocess.run(["bash", "-c", tiny(command)], cwd=work, env=env, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}{done.stderr[-5000:]}"
        logs[command] = done.stdout + done.stderr
        if command == MAIN:  # later commands write the same export directory
            shutil.copytree(work / EXPORT, work / "main-export")
    for index, block in enumerate(page_blocks("python")):
        (work / f".block{index}.py").write_text(block + "\n")
        done = subprocess.run([sys.executable, f".block{index}.py"], cwd=work, env=env, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert done.returncode == 0, f"{block}\n{done.stdout[-3000:]}{done.stderr[-5000:]}"
        logs[block] = done.stdout + done.stderr
    return work, logs


def test_the_page_shows_the_recipes_commands():
    commands = page_commands()
    assert commands[:2] == ["lightning-zero3 fit --config examples/configs/finetune_full.yaml", MAIN]
    assert f"{MAIN} --ckpt_path last" in commands
    assert any("finetune_lora.yaml" in c for c in commands)
    assert any("--model.init_args.activation_checkpointing true" in c for c in commands)
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Fine-tune your own Hugging Face checkpoint") :].split("\n## ")[0]
    shown = re.findall(r"```bash\n(.+?)\n```", section, flags=re.S)[0].splitlines()
    assert shown and set(shown) <= set(commands)  # the README's fine-tuning commands are among those run here


def test_every_command_of_the_page_runs(page_run):
    work, logs = page_run
    assert len(logs) == len(page_commands()) + len(page_blocks("python"))
    assert page_blocks("python") and any("from_pretrained" in block for block in page_blocks("python"))
    assert (work / "runs" / "pretrained" / "tiny-llama" / "tokenizer.json").is_file()  # the sample, made locally
    assert (work / "runs" / "data" / "sample.jsonl").is_file()
    assert "Restored all states from the checkpoint" in logs[f"{MAIN} --ckpt_path last"]
    assert (work / "runs" / "finetune-lora" / "export" / "adapter" / "adapter_config.json").is_file()
    llava = work / "runs" / "finetune-llava" / "export" / "model"  # the multimodal job, its sample made locally
    assert {"processor_config.json", "tokenizer.json", "model.safetensors"} <= {p.name for p in llava.iterdir()}
    assert (work / "runs" / "data-images" / "sample.jsonl").is_file()
    for switch in ("off", "on"):  # the activation-checkpointing measurement's commands
        assert len(list((work / f"rss-{switch}").glob("rank*.json"))) == 2


def response_loss(model_dir: Path, tokenizer_dir: Path, data: Path) -> float:
    """Mean loss over the response tokens of every row, tokenized by ``tokenizer_dir``'s tokenizer."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total, count = 0.0, 0
    with torch.no_grad():
        for _, row in read_rows(data):
            ids, labels = tokenize(row, tokenizer, 256)
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
            targets = torch.tensor(labels[1:])
            total += torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum").item()
            count += int((targets != IGNORE).sum())
    return total / count


def test_the_main_commands_export_loads_as_the_original_and_has_learnt_the_responses(page_run):
    work, _ = page_run
    export = work / "main-export"
    names = {p.name for p in export.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    original = transformers.AutoTokenizer.from_pretrained(work / "my-model")
    assert tokenizer.get_vocab() == original.get_vocab() and tokenizer.chat_template == original.chat_template
    before = response_loss(work / "my-model", work / "my-model", work / "my-data.jsonl")
    after = response_loss(export, export, work / "my-data.jsonl")
    print(f"loss on the training responses: {before:.3f} (checkpoint) -> {after:.3f} (export)")
    assert after < 0.9 * before
