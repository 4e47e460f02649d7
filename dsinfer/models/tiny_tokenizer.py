"""A tiny, real, DeepSeek-V4-shaped tokenizer for tests.

:func:`build_tiny_tokenizer` trains a byte-level BPE with the ``tokenizers``
library on the small corpus embedded below and writes ``tokenizer.json`` and
``tokenizer_config.json`` laid out like DeepSeek-V4's:

* ids 0, 1, 2: ``<｜begin▁of▁sentence｜>``, ``<｜end▁of▁sentence｜>``, ``<｜▁pad▁｜>``;
* then the 256 byte symbols and the learned merges;
* then, only if the corpus ran out of merges, ``<｜place▁holder▁no▁N｜>``
  reserved slots (as DeepSeek reserves 128000..128798);
* then every token of :data:`dsinfer.tokenizer.DEEPSEEK_V4_SPECIAL_TOKENS`
  (minus the three above), in real-id order, ending at ``vocab_size - 1``.

Normalizer, pre-tokenizer (digit / CJK / punctuation splits then byte-level),
decoder and the per-token ``special``/``normalized`` flags mirror the real V4
files, so code written against this tokenizer behaves the same on the real one.
The build is deterministic: the same ``vocab_size`` gives byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers

from dsinfer.tokenizer import (
    BOS_TOKEN,
    DEEPSEEK_V4_SKIPPED_TOKENS,
    DEEPSEEK_V4_SPECIAL_TOKENS,
    EOS_TOKEN,
    PAD_TOKEN,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
)

__all__ = ["TINY_CORPUS", "TINY_MODEL_MAX_LENGTH", "build_tiny_tokenizer", "min_tiny_vocab_size"]

TINY_MODEL_MAX_LENGTH = 1048576  # same as DeepSeek-V4

_LEADING = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
_TOP_TOKENS = tuple(t for t in DEEPSEEK_V4_SPECIAL_TOKENS if t not in _LEADING)
_N_BYTES = 256


# DeepSeek-V4's pre-tokenizer: runs of up to three digits, runs of CJK / kana,
# then a GPT-style split of words, punctuation and whitespace; then byte-level.
def _digits(group: int) -> str:
    return rf"\p{{N}}{{1,{group}}}"


_CJK = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_WORDS = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
    r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

TINY_CORPUS = """\
The small inference engine reads a prompt, turns it into token ids, and runs the model one step at a time.
Each step produces a distribution over the vocabulary; the sampler picks the next token and the loop goes on
until the model writes the end of sentence token or the request reaches its length limit.
A good tokenizer keeps common words whole: the, and, of, to, in, is, that, for, with, on, as, it, this, by.
Rare words such as thermodynamics, photosynthesis or counterintuitive are split into smaller pieces.
Numbers are cut into groups of at most three digits, so 1234567 becomes 123, 456 and 7.
On Monday the weather was cold and grey; on Tuesday it rained; by Friday the sun was out again.
She said: "Please bring two apples, three pears and a loaf of bread." He answered, "Sure, I will."
The quick brown fox jumps over the lazy dog while the cat sleeps on the warm windowsill.
Questions? Answers! Lists; colons: dashes - and (parentheses) [brackets] {braces} <angles>.
Attention weights are computed from queries and keys; the values are mixed by those weights.
Mixture-of-experts layers route every token to a few experts and add their outputs together.
The cache stores keys and values so that earlier tokens are not processed twice.

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    result = []
    a, b = 0, 1
    for _ in range(n):
        result.append(a)
        a, b = b, a + b
    return result


class KVCache:
    def __init__(self, max_tokens: int = 4096) -> None:
        self.max_tokens = max_tokens
        self.keys = []
        self.values = []

    def append(self, key, value):
        if len(self.keys) >= self.max_tokens:
            raise ValueError("cache is full")
        self.keys.append(key)
        self.values.append(value)


if __name__ == "__main__":
    print(fibonacci(10))
    for i, x in enumerate([3, 1, 4, 1, 5, 9, 2, 6]):
        print(f"{i}: {x * x}")

{"model": "tiny", "vocab_size": 512, "layers": [0, 1, 2], "rope_theta": 10000.0, "tie_embeddings": false}
{"role": "user", "content": "What is the capital of France?"}
{"role": "assistant", "content": "The capital of France is Paris."}
const total = items.map((x) => x.price * x.count).reduce((a, b) => a + b, 0);
SELECT name, count(*) FROM requests WHERE status = 'done' GROUP BY name ORDER BY 2 DESC;
for (int i = 0; i < n; ++i) { sum += data[i]; }  // accumulate the values
$ pip install --upgrade tokenizers && python -m pytest -q tests/

今天天气很好，我们一起去公园散步吧。
人工智能正在改变我们的生活和工作方式。
这个模型可以理解中文，也可以理解英文和代码。
请把这段文字翻译成英文，并解释其中的意思。
我喜欢读书、写字和学习新的知识。
北京是中国的首都，上海是中国最大的城市之一。
深度学习模型需要大量的数据和计算资源来训练。
你好，世界！谢谢你的帮助。我们明天见。
こんにちは、世界。ありがとうございます。カタカナとひらがなの例です。
Mixed lines happen too: 模型 model, 数据 data, 你好 hello, 2024年5月17日 at 09:30.
Emoji and symbols show up in chat: 🙂 👍 🎉 ✨ → ← ≤ ≥ ± × ÷ € £ ¥ © ® ™ ° µ.
Accented words: café, naïve, résumé, façade, jalapeño, Zürich, São Paulo, Ångström.
"""


def min_tiny_vocab_size() -> int:
    """Smallest ``vocab_size`` :func:`build_tiny_tokenizer` accepts (no merges at all)."""
    return len(_LEADING) + _N_BYTES + len(_TOP_TOKENS)


def _added_token(token_id: int, content: str, *, special: bool) -> dict:
    # Same flags as DeepSeek-V4: special tokens are matched on the raw text,
    # the named non-special chat tokens on the (identity) normalized text.
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": not special,
        "special": special,
    }


def _train_bpe(n_base: int, corpus: list[str], digit_group: int) -> dict:
    """Train the byte-level BPE on ``corpus`` (lines); return its tokenizer.json as a dict."""
    tok = tokenizers.Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_digits(digit_group)), behavior="isolated", invert=False),
            pre_tokenizers.Split(Regex(_CJK), behavior="isolated", invert=False),
            pre_tokenizers.Split(Regex(_WORDS), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=n_base,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(_LEADING),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return json.loads(tok.to_str())


FILLERS = ("placeholders", "words")


def build_tiny_tokenizer(
    out_dir: Path,
    vocab_size: int = 512,
    corpus: list[str] | None = None,
    digit_group: int = 3,
    filler: str = "placeholders",
) -> None:
    """Write a DeepSeek-V4-shaped ``tokenizer.json`` + ``tokenizer_config.json`` into ``out_dir``.

    The vocabulary has exactly ``vocab_size`` ids with no holes.  Raises
    ``ValueError`` when ``vocab_size`` is below :func:`min_tiny_vocab_size`.
    ``corpus`` (lines; default :data:`TINY_CORPUS`) is what the merges are learned from; ``digit_group`` is
    the longest run of digits one pre-token holds (DeepSeek: 3; 1 gives one token per digit). ``filler`` says
    what the ids the corpus leaves over become: ``placeholders``, reserved special slots as DeepSeek has them
    (they decode to nothing), or ``words``, non-special added tokens that each decode to a word of their own and
    encode back to their ids. The server streams no added token (it takes each for a control token), so the
    slice's tokenizer then moves the words into the BPE vocabulary (``dsinfer.bench.shapes.words_into_vocabulary``),
    where a model with random weights streams text at every token, as a real one does.
    """
    if filler not in FILLERS:
        raise ValueError(f"filler must be one of {FILLERS}, got {filler!r}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int, got {vocab_size!r}")
    minimum = min_tiny_vocab_size()
    if vocab_size < minimum:
        raise ValueError(f"vocab_size {vocab_size} is too small: the tiny tokenizer needs at least {minimum}")
    out_dir = Path(out_dir)

    n_base = vocab_size - len(_TOP_TOKENS)
    lines = TINY_CORPUS.splitlines(keepends=True) if corpus is None else list(corpus)
    data = _train_bpe(n_base, lines, digit_group)
    vocab: dict[str, int] = data["model"]["vocab"]
    if sorted(vocab.values()) != list(range(len(vocab))) or any(vocab.get(t) != i for i, t in enumerate(_LEADING)):
        raise RuntimeError("BPE training produced an unexpected vocabulary layout")

    added = [_added_token(i, t, special=True) for i, t in enumerate(_LEADING)]
    next_id = len(vocab)
    # A corpus too small for the requested size leaves a gap: fill it with
    # reserved slots, as DeepSeek does below its named control tokens.
    slot = 0
    while next_id < n_base:
        name = f"<｜place▁holder▁no▁{slot}｜>" if filler == "placeholders" else f" w{slot:06d}"
        slot += 1
        if name in _TOP_TOKENS:
            continue
        added.append(_added_token(next_id, name, special=filler == "placeholders"))
        next_id += 1
    for content in _TOP_TOKENS:
        added.append(_added_token(next_id, content, special=content in DEEPSEEK_V4_SKIPPED_TOKENS))
        next_id += 1
    assert next_id == vocab_size
    data["added_tokens"] = added
    # Write merges as "left right" strings like DeepSeek's file (byte-level
    # symbols never contain a literal space, so this is unambiguous).
    data["model"]["merges"] = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]

    text = json.dumps(data, ensure_ascii=False, indent=2) + "\n"
    _check(text, added, vocab_size)

    special = {"lstrip": False, "normalized": True, "rstrip": False, "single_word": False}
    config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": {"__type": "AddedToken", "content": BOS_TOKEN, **special},
        "clean_up_tokenization_spaces": False,
        "eos_token": {"__type": "AddedToken", "content": EOS_TOKEN, **special},
        "legacy": True,
        "model_max_length": TINY_MODEL_MAX_LENGTH,
        # DeepSeek-V4 pads with the eos token although <｜▁pad▁｜> (id 2) exists.
        "pad_token": {"__type": "AddedToken", "content": EOS_TOKEN, **special},
        "sp_model_kwargs": {},
        "unk_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / TOKENIZER_FILE).write_bytes(text.encode("utf-8"))
    config_text = json.dumps(config, ensure_ascii=False, indent=2) + "\n"
    (out_dir / TOKENIZER_CONFIG_FILE).write_bytes(config_text.encode("utf-8"))


def _check(text: str, added: list[dict], vocab_size: int) -> None:
    """Reload the serialized tokenizer and verify the id layout before writing it."""
    tok = tokenizers.Tokenizer.from_str(text)
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(
            f"tiny tokenizer has {tok.get_vocab_size(with_added_tokens=True)} ids, expected {vocab_size}"
        )
    for entry in added:
        ids = tok.encode(entry["content"], add_special_tokens=False).ids
        if ids != [entry["id"]]:
            raise RuntimeError(f"tiny tokenizer encodes {entry['content']!r} as {ids}, expected [{entry['id']}]")
