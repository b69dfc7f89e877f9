"""A tiny randomly initialised Qwen2 model with its own byte-level BPE tokenizer, built offline.

Tests, the CPU mode and the examples need a real Hugging Face model folder that verl, vLLM and
transformers all load, without downloading anything. This module trains a small byte-level BPE
tokenizer on a built-in corpus and saves it with a randomly initialised ``Qwen2ForCausalLM``.

The model keeps its input and output embeddings untied: vLLM on CPU reloads tied embeddings
wrongly after a weight push, so a tied tiny model would hide or fake weight-sync bugs. The config
records no attention implementation; loaders pick one (the CPU mode passes ``sdpa``).

The output layer is drawn with std ``1/sqrt(hidden_size)`` (the other weights with transformers'
0.02), so the logits have unit scale, as a trained model's have room to. Under transformers' 0.02
alone the logits span so little that a frozen output layer caps what can be learnt: LoRA, which
leaves ``lm_head`` frozen, could give digit tokens at most 9% of the mass on the toy task, against
98% now.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

__all__ = ("IM_START", "TINY_MODEL_SPECIAL_TOKENS", "build_tiny_model", "build_tiny_tokenizer")

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TINY_MODEL_SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)

_META_FILE = "agl_tiny_model.json"
_LM_HEAD_STD = "hidden_size**-0.5"
"""Recorded in the meta file, so a folder built before the output layer's scale changed is told apart."""
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", _META_FILE)

# Qwen2-style chat template: each message is wrapped in <|im_start|>role ... <|im_end|>.
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = (
    "What is two plus three? Two plus three is five.",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Count from one to ten: one, two, three, four, five, six, seven, eight, nine, ten.",
    "def add(a, b):\n    return a + b\n",
    "The agent calls a tool, reads the observation and answers the question.",
    "Reward is one when the answer is correct and zero otherwise.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 1000.",
    "user: hello\nassistant: Hello! How can I help you today?",
    "Please think step by step, then give the final answer in a box.",
    "The quick brown fox jumps over the lazy dog.",
)


def build_tiny_model(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 2,
    replace_other: bool = False,
) -> Path:
    """Build (or reuse) a tiny Qwen2 model folder at ``path`` and return it.

    The folder holds a ``PreTrainedTokenizerFast`` (byte-level BPE, chat template, pad token
    ``<|endoftext|>``, eos token ``<|im_end|>``) and a randomly initialised fp32
    ``Qwen2ForCausalLM`` with untied embeddings, both saved with ``save_pretrained``. The same
    arguments always give the same tokenizer and the same weights. ``vocab_size`` is an upper
    bound: training stops when the built-in corpus has no more merges (about 490 tokens).

    The folder is written to a temporary sibling and renamed into place, so a folder at ``path``
    is always complete; an existing complete folder built with the same arguments is reused. One
    built with other arguments (or by an older version of this function) is replaced when
    ``replace_other`` is set: the embedded default's cache folder is agl's own.

    Raises:
        ValueError: an argument is out of range, or ``path`` holds a tiny model built with
            other arguments and ``replace_other`` is not set.
        FileExistsError: ``path`` exists but is not a tiny model folder.
    """
    target = Path(path)
    params = _validated_params(
        seed=seed, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers
    )
    if target.exists() and not (replace_other and _is_other_tiny_model(target, params)):
        return _reuse(target, params)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_model(staging, params)
        if target.exists():  # the other build moves aside whole, so no reader finds half a folder
            aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.replaced.", dir=target.parent))
            target.rename(aside / target.name)
            shutil.rmtree(aside, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished the same folder first; its copy is as good as ours.
            if not target.exists():
                raise
            return _reuse(target, params)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _validated_params(*, seed: int, vocab_size: int, hidden_size: int, num_layers: int) -> dict[str, int]:
    min_vocab = 256 + len(TINY_MODEL_SPECIAL_TOKENS)
    if vocab_size < min_vocab:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: the byte alphabet and special tokens need {min_vocab}; "
            f"pass vocab_size >= {min_vocab}."
        )
    if hidden_size <= 0 or hidden_size % 32 != 0:
        raise ValueError(f"hidden_size={hidden_size} must be a positive multiple of 32 (4 heads of 8+ dims).")
    if num_layers <= 0:
        raise ValueError(f"num_layers={num_layers} must be positive.")
    return {"seed": seed, "vocab_size": vocab_size, "hidden_size": hidden_size, "num_layers": num_layers}


def _meta(params: dict[str, int]) -> dict[str, int | str]:
    """What the meta file records: the arguments and how the output layer was drawn."""
    return {**params, "lm_head_std": _LM_HEAD_STD}


def _is_other_tiny_model(target: Path, params: dict[str, int]) -> bool:
    """Whether ``target`` holds a tiny model (its meta file is there) built otherwise, or whose
    meta file cannot be read."""
    meta = target / _META_FILE
    if not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text()) != _meta(params)
    except ValueError:
        return True


def _reuse(target: Path, params: dict[str, int]) -> Path:
    missing = [name for name in _REQUIRED_FILES if not (target / name).is_file()]
    if missing:
        raise FileExistsError(
            f"path={str(target)!r} exists but is not a tiny model folder (missing {missing}); "
            "remove it or pass another path."
        )
    found = json.loads((target / _META_FILE).read_text())
    if found != _meta(params):
        raise ValueError(
            f"path={str(target)!r} holds a tiny model built with {found}, not {_meta(params)}; "
            "remove it or pass another path."
        )
    return target


def _write_model(folder: Path, params: dict[str, int]) -> None:
    tokenizer = build_tiny_tokenizer(params["vocab_size"])
    tokenizer.save_pretrained(folder)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=params["hidden_size"],
        intermediate_size=2 * params["hidden_size"],
        num_hidden_layers=params["num_layers"],
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        pad_token_id=_token_id(tokenizer, PAD_TOKEN),
        eos_token_id=_token_id(tokenizer, IM_END),
        bos_token_id=None,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(params["seed"])
        model = Qwen2ForCausalLM(config)
        torch.nn.init.normal_(model.lm_head.weight, std=params["hidden_size"] ** -0.5)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(folder)
    (folder / _META_FILE).write_text(json.dumps(_meta(params), sort_keys=True))


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int):
        raise TypeError(f"token {token!r} maps to {token_id!r}, not one id")
    return token_id


def build_tiny_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on the built-in corpus; deterministic for a given ``vocab_size``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(TINY_MODEL_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        chat_template=_CHAT_TEMPLATE,
        model_max_length=2048,
        padding_side="left",
    )
