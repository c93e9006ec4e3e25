"""A tiny random-weight Llama model and tokenizer, built locally without any download.

The model's output text is noise, but everything agentkv measures on a real vLLM server is
real: prompt lengths, prefix-cache hits, block eviction and prefill cost.

Invariants:

* Deterministic: the same ``seed``, ``vocab_size`` and :class:`ModelShape` give byte-identical
  files (for fixed versions of torch, transformers and tokenizers).
* Atomic and idempotent: the model is built in a temporary sibling directory and moved into
  place with ``os.replace``; a directory counts as complete only when its marker file (written
  last) matches the current format version, parameters and shape. Concurrent callers are safe: one
  of them wins the rename, the others discard their copies.

Module import is light: torch, transformers and tokenizers are imported inside the builder.
:func:`build_llama` builds any :class:`ModelShape` with the same tokenizer (the benchmark model
of :mod:`agentkv.bench.model` is one).

CLI: ``python -m agentkv.testing.tiny_model DIR [--seed N] [--vocab-size N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import shutil
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["FORMAT_VERSION", "MARKER_NAME", "TINY_SHAPE", "ModelShape", "build_llama", "build_tiny_model",
           "is_complete", "main"]

FORMAT_VERSION = 2
MARKER_NAME = ".agentkv-tiny-model-complete"

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
END = "<|end|>"
ROLE_TOKENS = ["<|system|>", "<|tools|>", "<|user|>", "<|assistant|>", "<|tool|>"]
SPECIAL_TOKENS = [PAD, BOS, EOS, END, *ROLE_TOKENS]

# Tools are rendered right after the system message (one JSON object per line), then every
# other message as "<|role|>\ncontent<|end|>\n". Assistant tool calls are rendered as JSON.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- '<|system|>\\n' + (messages[0]['content'] or '') + '<|end|>\\n' }}"
    "{%- set rest = messages[1:] %}"
    "{%- else %}"
    "{%- set rest = messages %}"
    "{%- endif %}"
    "{%- if tools %}"
    "{{- '<|tools|>\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '<|end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in rest %}"
    "{{- '<|' + message['role'] + '|>\\n' }}"
    "{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
    "{%- if message['tool_calls'] %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{{- '\\n' + {'name': fn['name'], 'arguments': fn['arguments']} | tojson }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)

MAX_POSITION_EMBEDDINGS = 8192


@dataclass(frozen=True)
class ModelShape:
    """A Llama's size. vLLM's CPU attention needs ``hidden_size / num_heads`` in {32, 64, 80, 96,
    112, 128, 160, 192, 224, 256, 512}."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int

    def __post_init__(self) -> None:
        head_dim, rest = divmod(self.hidden_size, self.num_heads)
        if rest or head_dim not in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512):
            raise ValueError(f"head_dim {self.hidden_size}/{self.num_heads} is not one vLLM's CPU attention supports")


# head_dim = 128 / 4 = 32; ~2.4 M parameters with the default vocabulary of 4096.
TINY_SHAPE = ModelShape(hidden_size=128, num_layers=2, num_heads=4, intermediate_size=1536)

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "can more about said time what other some into could them only new first then do any these "
    "like may such over our most after very made also did many before must through back years "
    "where much your way well down should because each just those people how too little state "
    "good very make world still own see men work long get here between both life being under "
    "never day same another know while last might great old year off come since against go came "
    "right used take three agent tool call search result plan step task answer question user "
    "assistant system memory cache block prefix token request response model server session"
).split()
_ONSETS = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
           "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "sp", "st", "str", "th", "tr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "ou", "oa"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "nt", "rk", "st", "ck", "sh"]
_JSON_KEYS = ["name", "description", "parameters", "type", "properties", "required", "query",
              "city", "date", "limit", "path", "content", "id", "status", "result", "items",
              "arguments", "function", "role", "tool_call_id", "enum", "default", "units"]


def _pseudo_word(rng: random.Random) -> str:
    return "".join(
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
        for _ in range(rng.randint(1, 3))
    )


def _sentence(rng: random.Random) -> str:
    words = [
        rng.choice(_WORDS) if rng.random() < 0.7 else _pseudo_word(rng)
        for _ in range(rng.randint(5, 18))
    ]
    text = " ".join(words)
    if rng.random() < 0.2:
        text += f" {rng.randint(0, 9999)}"
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "?", "!", ":", ";"])


def _json_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.random()
    if depth < 2 and kind < 0.25:
        return {rng.choice(_JSON_KEYS): _json_value(rng, depth + 1) for _ in range(rng.randint(1, 4))}
    if depth < 2 and kind < 0.35:
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind < 0.55:
        return rng.randint(-1000, 100000)
    if kind < 0.6:
        return rng.choice([True, False, None])
    if kind < 0.65:
        return round(rng.uniform(-100, 100), 3)
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 5)))


def _tool_text(rng: random.Random) -> str:
    name = f"{rng.choice(_WORDS)}_{_pseudo_word(rng)}"
    if rng.random() < 0.5:
        obj: object = {
            "type": "function",
            "function": {
                "name": name,
                "description": _sentence(rng),
                "parameters": {
                    "type": "object",
                    "properties": {
                        rng.choice(_JSON_KEYS): {"type": rng.choice(["string", "integer", "boolean"]),
                                                 "description": _sentence(rng)}
                        for _ in range(rng.randint(1, 4))
                    },
                },
            },
        }
    else:
        obj = {"name": name, "arguments": _json_value(rng)}
    return json.dumps(obj, indent=rng.choice([None, 2]))


def _corpus(seed: int, n_docs: int = 6000) -> list[str]:
    """Deterministic English-ish prose, chat transcripts and JSON tool text."""
    rng = random.Random(f"agentkv-tiny-corpus-{seed}")
    docs = []
    for _ in range(n_docs):
        r = rng.random()
        if r < 0.5:
            docs.append(" ".join(_sentence(rng) for _ in range(rng.randint(1, 6))))
        elif r < 0.8:
            docs.append(_tool_text(rng))
        else:
            role = rng.choice(["system", "user", "assistant", "tool"])
            docs.append(f"<|{role}|>\n{_sentence(rng)}<|end|>\n")
    return docs


def is_complete(directory: str | Path, *, seed: int = 0, vocab_size: int = 4096,
                shape: ModelShape = TINY_SHAPE) -> bool:
    """True if ``directory`` holds a finished build with this format version, parameters and shape."""
    try:
        marker = json.loads((Path(directory) / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return bool(marker == _marker(seed, vocab_size, shape))


def _marker(seed: int, vocab_size: int, shape: ModelShape) -> dict[str, object]:
    return {"format_version": FORMAT_VERSION, "seed": seed, "vocab_size": vocab_size, "shape": asdict(shape)}


def _build_into(out: Path, seed: int, vocab_size: int, shape: ModelShape) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    # Tokenizer: byte-level BPE trained on the built-in corpus.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    if tok.get_vocab_size() > vocab_size:  # pragma: no cover - the trainer respects the limit
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens > {vocab_size}")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[END, *ROLE_TOKENS],
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(out)

    # Model: random Llama in bfloat16; the generator state is restored afterwards.
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(out)

    (out / MARKER_NAME).write_text(json.dumps(_marker(seed, vocab_size, shape), sort_keys=True) + "\n")


def build_tiny_model(directory: str | Path, *, seed: int = 0, vocab_size: int = 4096) -> Path:
    """Build (once) the tiny random Llama model plus tokenizer in ``directory``; return its path."""
    return build_llama(directory, TINY_SHAPE, seed=seed, vocab_size=vocab_size)


_STALE_BUILD_SECONDS = 3600.0


def build_llama(directory: str | Path, shape: ModelShape, *, seed: int = 0, vocab_size: int = 4096) -> Path:
    """Build (once) a random Llama of ``shape`` plus the tokenizer in ``directory``; return its path.

    Returns immediately if ``directory`` already holds a complete build with the same
    parameters and shape. An incomplete or outdated directory at that path is replaced.
    """
    target = Path(directory).resolve()
    complete = functools.partial(is_complete, seed=seed, vocab_size=vocab_size, shape=shape)
    if complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # a build killed before its ``finally`` (SIGTERM, SIGKILL) leaves its directory: an hour on,
    # no build of this machine's is still writing it
    for left in target.parent.glob(f".{target.name}.tmp-*"):
        with contextlib.suppress(OSError):
            if time.time() - left.stat().st_mtime > _STALE_BUILD_SECONDS:
                shutil.rmtree(left, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _build_into(tmp, seed, vocab_size, shape)
        os.chmod(tmp, 0o755)  # mkdtemp creates 0700; the model is meant to be shared
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        for _ in range(3):
            try:
                os.replace(tmp, target)  # succeeds if target is absent or an empty directory
                return target
            except OSError:
                if complete(target):
                    return target  # a concurrent caller won the race
                # Stale or outdated content: move it aside, then retry.
                stale = target.parent / f".{target.name}.stale-{uuid.uuid4().hex}"
                try:
                    os.replace(target, stale)
                except OSError:
                    continue
                shutil.rmtree(stale, ignore_errors=True)
        raise RuntimeError(f"could not move the model into place at {target}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the agentkv tiny test model.")
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args(argv)
    print(build_tiny_model(args.directory, seed=args.seed, vocab_size=args.vocab_size))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
