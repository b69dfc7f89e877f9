"""build_tiny_model: an offline Qwen2 folder that transformers loads back, deterministic by seed."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from agl_trainer.local.tiny_model import build_tiny_model
from agl_trainer.local.toy_task import is_digit_text


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_tokenizer_round_trips_text(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    text = "Hello world! def f(x):\n    return x * 42  # é ✓"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_has_distinct_pad_and_eos_special_tokens(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.encode("<|im_start|>") == [tokenizer.convert_tokens_to_ids("<|im_start|>")]


def test_chat_template_wraps_messages_and_adds_generation_prompt(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_model_is_untied_fp32_qwen2_matching_the_tokenizer(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa")
    config = model.config
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("qwen2", 128, 2)
    assert config.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.dtype == torch.float32
    assert config.vocab_size == len(tokenizer)
    assert (config.pad_token_id, config.eos_token_id) == (tokenizer.pad_token_id, tokenizer.eos_token_id)


def test_model_runs_a_forward_pass(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa")
    ids = torch.tensor([tokenizer.encode("two plus three is five")])
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_same_seed_gives_identical_weights_and_tokenizer(tiny_model: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", seed=0)
    first, second = load_file(tiny_model / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert (tiny_model / "tokenizer.json").read_text() == (again / "tokenizer.json").read_text()


def test_other_seed_gives_other_weights(tiny_model: Path, tmp_path: Path) -> None:
    other = build_tiny_model(tmp_path / "other", seed=1)
    first, second = load_file(tiny_model / "model.safetensors"), load_file(other / "model.safetensors")
    assert not torch.equal(first["model.embed_tokens.weight"], second["model.embed_tokens.weight"])


def test_existing_folder_with_same_arguments_is_reused_untouched(tiny_model: Path) -> None:
    before = (tiny_model / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(tiny_model, seed=0) == tiny_model
    assert (tiny_model / "model.safetensors").stat().st_mtime_ns == before


def test_existing_folder_built_with_other_arguments_is_refused(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match="seed"):
        build_tiny_model(tiny_model, seed=7)


def test_existing_folder_built_with_other_arguments_is_replaced_when_asked(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path / "model", seed=7)
    assert build_tiny_model(folder, seed=0, replace_other=True) == folder
    rebuilt, fresh = (
        load_file(folder / "model.safetensors"),
        load_file(build_tiny_model(tmp_path / "fresh", seed=0) / "model.safetensors"),
    )
    assert all(torch.equal(rebuilt[name], fresh[name]) for name in fresh)


def test_a_folder_of_an_older_agl_whose_meta_lacks_the_output_layers_scale_is_replaced_when_asked(
    tiny_model: Path, tmp_path: Path
) -> None:
    older = tmp_path / "older"
    shutil.copytree(tiny_model, older)
    meta = json.loads((older / "agl_tiny_model.json").read_text())
    del meta["lm_head_std"]
    (older / "agl_tiny_model.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="lm_head_std"):
        build_tiny_model(older, seed=0)
    assert build_tiny_model(older, seed=0, replace_other=True) == older
    assert json.loads((older / "agl_tiny_model.json").read_text())["lm_head_std"] == "hidden_size**-0.5"
    assert [item.name for item in tmp_path.iterdir()] == ["older"]


def test_existing_foreign_folder_is_refused_even_when_replacing_is_asked(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({}))
    with pytest.raises(FileExistsError, match="not a tiny model folder"):
        build_tiny_model(foreign, replace_other=True)


def test_a_frozen_output_layer_can_give_digit_tokens_most_of_the_mass(tiny_model: Path) -> None:
    """What LoRA can learn on the toy task: it leaves lm_head and the final norm frozen, so the
    policy can only steer the normalised last hidden state. The best such state, found by gradient
    ascent, must give the digit tokens most of the next-token mass (0.09 at most under
    transformers' default init of the output layer)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    weight = model.lm_head.weight.detach()
    digits = torch.tensor([is_digit_text(tokenizer.decode([token])) for token in range(weight.shape[0])])
    size = weight.shape[1]
    torch.manual_seed(0)
    direction = torch.randn(size, requires_grad=True)
    optimizer = torch.optim.Adam([direction], lr=0.05)
    for _ in range(500):
        hidden = direction / direction.norm() * size**0.5  # RMS-normalised, the norm's weight is 1
        digit_mass = torch.log_softmax(weight @ hidden, dim=0)[digits].logsumexp(dim=0)
        optimizer.zero_grad()
        (-digit_mass).backward()
        optimizer.step()
    assert model.model.norm.weight.eq(1).all()
    assert digit_mass.exp().item() > 0.9


def test_existing_foreign_folder_is_refused(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({}))
    with pytest.raises(FileExistsError, match="not a tiny model folder"):
        build_tiny_model(foreign)


def test_build_leaves_no_staging_folder_behind(tmp_path: Path) -> None:
    build_tiny_model(tmp_path / "model", seed=3)
    assert [item.name for item in tmp_path.iterdir()] == ["model"]


def test_too_small_vocab_is_refused_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"vocab_size=100 .* vocab_size >= 259"):
        build_tiny_model(tmp_path / "model", vocab_size=100)
