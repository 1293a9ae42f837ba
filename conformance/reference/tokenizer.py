"""The tiny twins' tokenizer: a byte-level BPE trained offline, in code, with `tokenizers`.

The training corpus is synthetic and deterministic (word problems with numbers, chat-like
turns, plain English words, and a seeded lexicon of pseudo-words that gives the trainer
enough pairs to reach a 32k vocabulary), generated here from a fixed seed, so every machine
trains the same tokenizer and any text encodes (byte-level: no unknown tokens).  Shaped for
SGLang's own test kits: "hi" is one token and "hi" * 257 is 257 tokens (no word of the
corpus contains "ih", so no merge spans two "hi"), the vocabulary covers the token ids
0..31999 their radix-cache kit sends.
``save_tokenizer(folder)`` writes ``tokenizer.json`` and ``tokenizer_config.json`` (with a
ChatML chat template) in the form ``transformers.AutoTokenizer`` (hence SGLang) loads;
``TwinTokenizer`` is the kit's light runtime view of the same files.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD, EOS, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, EOS, IM_START, IM_END]  # ids 0, 1, 2, 3
CORPUS_SEED = 1729
CORPUS_LINES = 3000
LEXICON_WORDS = 30000  # pseudo-words: enough distinct pairs for a 32k-entry BPE
TRAINER_VERSION = 2  # bump when the trainer settings below change

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_NAMES = "Ann Ben Carla Dev Emma Farid Gina Hugo Iris Jon Kira Liam Mona Nate Omar Pia Raj Sara Tom Uma".split()
_ITEMS = ("apples eggs books coins cookies pencils marbles stickers tickets cupcakes shirts "
          "boxes bottles flowers candies cards toys pages miles dollars hours minutes").split()
_VERBS = "buys sells sold gives gave finds makes made reads eats collects earns spends loses saves pays".split()
_WORDS = ("the a and of to in is it that for on with as was he she they each more than how many "
          "much total left per day week every half twice three times what does have has had "
          "then after before if so all some her his their there are were at by from one two "
          "answer question step first next finally because cost price store school friend").split()
_ENGLISH = ("about after again also always another any around away back be been being best better big "
            "both bring brown but call came can capital city come could country day detail did do dog down "
            "each end even every fast few find five follow for fox found from give go good great happen "
            "happens help here high him home house if into just jump keep kind know large last late lazy "
            "learn let life like line little live long look made make man many may me might more most "
            "move much must my name near need never new next night no not now number of off old on once "
            "only open other our out over own part people place play point population quick read right "
            "said same say see seem should show side small so something sound still story such take tell "
            "than thank that the them then there these they thing think this those though three through "
            "time to today together too try turn two under until up us use very want water way we well "
            "went were what when where which while who why will with without word work world would write "
            "year yes yet you young your hello hi wizard joke kingdom magical France Paris").split()
_ONSETS = "b c d f g h j k l m n p r s t v w z br cr dr fr gr pr tr bl cl fl gl pl sl sh ch th st sp sk sm sn qu".split()
_VOWELS = "a e i o u ai ea ee oo ou io ia ue".split()
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "rk", "ng", "ck", "x"]


def _number(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.6:
        return str(rng.randint(0, 100))
    if kind < 0.85:
        return str(rng.randint(100, 100000))
    return f"{rng.randint(0, 99)}.{rng.randint(0, 99):02d}"


def _problem_line(rng: random.Random) -> str:
    name, other = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    a, b = _number(rng), _number(rng)
    templates = (
        f"{name} {rng.choice(_VERBS)} {a} {item} and {other} {rng.choice(_VERBS)} {b} more. How many {item} in total?",
        f"Each {item[:-1]} costs ${a}. {name} buys {b} of them. How much does {name} spend?",
        f"{name} has {a} {item}. {name} gives {b} to {other}. {a} - {b} = <<{a}-{b}>>. #### {b}",
        f"If {name} {rng.choice(_VERBS)} {a} {item} per day, then in {b} days that is {a} * {b} {item}.",
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 16))) + f" {a}.",
        f"Q: What is {a} + {b}?\nA: {a} + {b} = {rng.randint(0, 999)}. The answer is {rng.randint(0, 999)}.",
    )
    return rng.choice(templates)


def pseudo_lexicon(n_words: int, rng: random.Random) -> list[str]:
    """``n_words`` distinct syllable words; none contains "ih" (so "hi" runs never merge)."""
    words: list[str] = []
    seen = set(_ENGLISH) | set(_WORDS)
    while len(words) < n_words:
        w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 4)))
        if w not in seen and "ih" not in w:
            seen.add(w)
            words.append(w)
    return words


def synthetic_corpus(n_lines: int = CORPUS_LINES, seed: int = CORPUS_SEED, lexicon_words: int = LEXICON_WORDS) -> list[str]:
    """The deterministic training corpus: word problems, arithmetic, chat turns, English words
    and pseudo-word sentences."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        line = _problem_line(rng)
        if i % 7 == 0:
            line = f"{IM_START}user\n{line}{IM_END}\n{IM_START}assistant\n{_problem_line(rng)}{IM_END}"
        lines.append(line)
    english = list(_ENGLISH)
    for _ in range(n_lines):
        words = rng.sample(english, rng.randint(4, 12))
        lines.append(words[0].capitalize() + " " + " ".join(words[1:]) + rng.choice((".", "?", "!", ",")))
    lexicon = pseudo_lexicon(lexicon_words, rng)
    for i in range(0, len(lexicon), 8):
        group = lexicon[i : i + 8]
        for _ in range(3):
            rng.shuffle(group)
            lines.append(" ".join(group) + rng.choice((".", ",", "?", "!", "")))
    return lines


@functools.lru_cache(maxsize=1)
def tokenizer_fingerprint() -> str:
    """Digest of the corpus and trainer version; part of every twin's spec hash."""
    blob = f"{TRAINER_VERSION}\n" + "\n".join(synthetic_corpus())
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=4)
def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train the byte-level BPE (digits split one by one) to exactly ``vocab_size`` entries."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(), trainer=trainer)
    return tok


def save_tokenizer(folder: Path, vocab_size: int, max_context: int) -> None:
    """Train and write tokenizer.json + tokenizer_config.json (with the chat template)."""
    tok = train_tokenizer(vocab_size)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} entries > model vocab {vocab_size}")
    tok.save(str(folder / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "rstrip": False, "normalized": False,
                                  "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_context,
        "pad_token": PAD,
        "eos_token": IM_END,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def special_token_ids() -> dict[str, int]:
    """Ids of the special tokens (fixed by their order in the trainer)."""
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}


class TwinTokenizer:
    """Runtime view of a saved twin tokenizer: encode, decode, chat template."""

    def __init__(self, folder: Path) -> None:
        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(config["chat_template"])
        self.eos_token_id = self._tok.token_to_id(config["eos_token"])
        self.pad_token_id = self._tok.token_to_id(config["pad_token"])
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added; special-token strings map to their ids)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens dropped unless ``skip_special_tokens`` is False."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        """The ChatML prompt text for ``messages`` (list of {"role", "content"} dicts)."""
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt)
