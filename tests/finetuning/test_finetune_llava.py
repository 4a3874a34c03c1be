"""The multimodal fine-tuning job (``examples/configs/finetune_llava.yaml``) through ``lightning-zero3 fit``
under zero3 and DDP on 2 CPU processes: a tiny LLaVA-Next written here with its processor, image
conversation rows with generated PNG images (``tests/scripts/finetune_llava_run.py``, one spawned job)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from distributed import run_script

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

SCRIPT = Path(__file__).parents[1] / "scripts" / "finetune_llava_run.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("finetune-llava")
    run_script(SCRIPT, out)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_zero3_losses_equal_ddps_on_image_conversations(ranks):
    for result in ranks:
        zero3, ddp = result["zero3"]["losses"], result["ddp"]["losses"]
        assert len(zero3) == len(ddp) == 4
        assert zero3 == pytest.approx(ddp, rel=1e-6, abs=0)
    assert ranks[0]["zero3"]["losses"] != ranks[1]["zero3"]["losses"]  # each rank trained on its own rows


def test_the_generator_after_the_load_is_ddps_after_from_pretrained(ranks):
    for result in ranks:
        assert result["zero3"]["rand_after_load"] == result["ddp"]["rand_after_load"]


def test_the_vision_tower_is_frozen_and_the_projector_and_language_model_train(ranks):
    for result in ranks:
        for run in ("zero3", "ddp"):
            assert result[run]["frozen"] == ["vision_tower"], run
            assert {"multi_modal_projector", "language_model", "lm_head"} <= set(result[run]["trained"]), run
        units = result["zero3"]["units"]  # the tower's units hold no gradient or optimizer shards
        assert units and all(trains == ("vision_tower" not in name) for name, trains in units.items())


def test_the_batches_carry_the_processors_images(ranks):
    for result in ranks:
        batch, tiles, channels, *pixels = result["zero3"]["pixel_values"]  # LLaVA-Next's any-resolution tiles
        assert batch == 2 and tiles >= 2 and channels == 3 and pixels == [32, 32]


def test_rows_are_processed_by_the_checkpoints_processor_and_a_bad_row_names_its_line(tmp_path):
    """In-process: the prompt and its image tokens are masked, images of different tile counts are padded
    with zero tiles in a batch, and a row whose image is missing fails naming the file and line."""
    from examples.finetune import TinyLlama, make_llava_next
    from examples.finetune_assets import write_sample_images
    from examples.sft_data import IGNORE, DataFormatError
    from examples.sft_images import ImageConversations, collate_images

    text = TinyLlama(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    checkpoint = make_llava_next(str(tmp_path / "model"), text)
    rows = write_sample_images(tmp_path / "data" / "rows.jsonl")
    data = ImageConversations(str(rows), processor=str(checkpoint), val_fraction=0)
    data.setup("fit")
    small, wide = data.train[0], data.train[2]  # red at 32x32, then at 32x64
    image_token = transformers.AutoConfig.from_pretrained(checkpoint).image_token_index
    for row in (small, wide):
        trained = [i for i, label in enumerate(row["labels"]) if label != IGNORE]
        assert trained and all(row["input_ids"][i] != image_token for i in trained)
        assert row["input_ids"][: trained[0]].count(image_token) > 0  # the image's tokens are in the prompt
    assert small["pixel_values"].shape[0] < wide["pixel_values"].shape[0]
    batch = collate_images([small, wide], data.pad_id)
    assert batch["pixel_values"].shape[:2] == (2, wide["pixel_values"].shape[0])
    padding = batch["pixel_values"][0, small["pixel_values"].shape[0] :]
    assert padding.numel() and not padding.any()
    assert batch["image_sizes"].tolist() == [[32, 32], [32, 64]]

    lines = rows.read_text().splitlines()
    lines[1] = lines[1].replace("images/", "missing/")
    bad = tmp_path / "data" / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:2: cannot read the image"):
        ImageConversations(str(bad), processor=str(checkpoint)).setup("fit")
