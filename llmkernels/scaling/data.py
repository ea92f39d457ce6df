"""Data for the scaling experiments: Python sources that exist offline wherever llmkernels runs.

``corpus="stdlib"``: the running interpreter's standard library (``*.py`` under
``sysconfig.get_paths()["stdlib"]``, installed packages excluded). ``corpus="stdlib+torch"`` (the
default) adds the Python sources of the installed ``torch`` package, a dependency of llmkernels:
a distribution's Python can ship a stripped standard library (Ubuntu's 3.12 without its test
suite: ~10 MB, ~2.8M tokens), too little for 20 tokens per parameter past ~150K parameters. The
corpus differs between Python and torch versions: the fingerprint records which. Files are sorted
by name (``stdlib/...``, ``torch/...``); a seeded shuffle splits them by file into train and held-out
sets. The tokenizer is a byte-level BPE trained on the train
files with Hugging Face ``tokenizers`` when it is installed, else raw UTF-8 bytes (256 ids); documents
are joined by an end-of-text token. Token arrays, the tokenizer and a ``meta.json`` are cached under
``<out>/data/<fingerprint>/`` and reused when the same corpus, split and tokenizer are asked for.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

EOT = "<|endoftext|>"
TOKENIZERS = ("bpe", "byte")
CORPORA = ("stdlib", "stdlib+torch")


@dataclass(frozen=True)
class DataConfig:
    """What corpus, split and tokenizer to build.

    Attributes:
        corpus: ``"stdlib"`` or ``"stdlib+torch"`` (see the module docstring).
        tokenizer: ``"bpe"`` (needs ``tokenizers``) or ``"byte"``.
        vocab_size: BPE vocabulary size, end-of-text included (ignored for ``"byte"``: 257).
        heldout_frac: share of the corpus bytes held out, by whole files.
        max_bytes: keep only a seeded random subset of files up to this many bytes (tests).
        seed: seeds the file shuffle (split and subset).
        root: read the ``*.py`` files under this directory instead of ``corpus``.
    """

    corpus: str = "stdlib+torch"
    tokenizer: str = "bpe"
    vocab_size: int = 8192
    heldout_frac: float = 0.05
    max_bytes: int | None = None
    seed: int = 0
    root: str | None = None

    def __post_init__(self):
        if self.corpus not in CORPORA:
            raise ValueError(f"corpus must be one of {CORPORA}, got {self.corpus!r}")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {self.tokenizer!r}")
        if not 0.0 < self.heldout_frac < 1.0:
            raise ValueError(f"heldout_frac must be in (0, 1), got {self.heldout_frac}")
        if self.tokenizer == "bpe" and self.vocab_size < 257:
            raise ValueError(f"vocab_size must be >= 257 for a byte-level BPE, got {self.vocab_size}")


@dataclass
class Corpus:
    """Token ids of the train and held-out splits (int32 tensors) and what made them."""

    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int
    meta: dict


def bpe_available() -> bool:
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return False
    return True


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_roots(cfg: DataConfig) -> dict[str, Path]:
    """``{label: directory}`` of the corpus's sources."""
    if cfg.root:
        return {"root": Path(cfg.root)}
    roots = {"stdlib": stdlib_root()}
    if cfg.corpus == "stdlib+torch":
        roots["torch"] = Path(torch.__file__).parent
    return roots


def list_files(roots: dict[str, Path]) -> list[tuple[str, Path]]:
    """``(name, path)`` of the ``*.py`` files under each root, ``name = label/relative path``,
    sorted by name; installed packages and caches skipped."""
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = []
    for label, root in roots.items():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in skip]
            for f in filenames:
                path = Path(dirpath, f)
                if f.endswith(".py") and path.is_file():
                    files.append((f"{label}/{path.relative_to(root).as_posix()}", path))
    return sorted(files)


def split_files(files: list, sizes: list[int], cfg: DataConfig) -> tuple[list, list]:
    """Seeded shuffle, optional subset (the files that fit in ``max_bytes``, in shuffled order),
    then the first files of the shuffled order up to ``heldout_frac`` of the bytes are held out.
    Both lists come back sorted."""
    order = list(range(len(files)))
    random.Random(cfg.seed).shuffle(order)
    if cfg.max_bytes is not None:
        kept, total = [], 0
        for i in order:  # every file that still fits, in the shuffled order
            if total + sizes[i] <= cfg.max_bytes:
                kept.append(i)
                total += sizes[i]
        order = kept
    total = sum(sizes[i] for i in order)
    val, val_bytes = [], 0
    for i in order:
        if val_bytes >= cfg.heldout_frac * total:
            break
        val.append(i)
        val_bytes += sizes[i]
    if len(val) == len(order):
        raise ValueError(f"too few files ({len(order)}) to hold out {cfg.heldout_frac:.0%} and train on the rest")
    train = sorted(set(order) - set(val))
    return [files[i] for i in train], [files[i] for i in sorted(val)]


def fingerprint(files: list[tuple[str, Path]], sizes: list[int], cfg: DataConfig) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"cfg": asdict(cfg), "python": sys.version.split()[0], "torch": torch.__version__}).encode())
    for (name, _), n in zip(files, sizes):
        h.update(f"{name}:{n}\n".encode())
    return h.hexdigest()[:16]


def _read(p: Path) -> str:
    return p.read_bytes().decode("utf-8", errors="replace")


def train_bpe(texts: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style pre-tokenisation, all 256 bytes in the base alphabet)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _join(docs: list[list[int]], eot: int) -> np.ndarray:
    sep = np.asarray([eot], dtype=np.int32)
    return np.concatenate([part for ids in docs for part in (np.asarray(ids, dtype=np.int32), sep)])


def _tokenize(cfg: DataConfig, train_files: list, val_files: list, cache: Path):
    train_texts = [_read(p) for _, p in train_files]
    val_texts = [_read(p) for _, p in val_files]
    if cfg.tokenizer == "bpe":
        tok = train_bpe(train_texts, cfg.vocab_size)
        tok.save(str(cache / "tokenizer.json"))
        eot = tok.token_to_id(EOT)
        encode = lambda texts: [e.ids for e in tok.encode_batch(texts)]  # noqa: E731
        vocab = tok.get_vocab_size()
    else:
        eot, vocab = 256, 257
        encode = lambda texts: [list(t.encode("utf-8")) for t in texts]  # noqa: E731
    return _join(encode(train_texts), eot), _join(encode(val_texts), eot), vocab, eot


def prepare(cfg: DataConfig, cache_dir: str | os.PathLike, log=print) -> Corpus:
    """Build (or load from ``cache_dir``) the tokenized corpus described by ``cfg``."""
    if cfg.tokenizer == "bpe" and not bpe_available():
        raise ImportError("tokenizer='bpe' needs the `tokenizers` package (pip install tokenizers), "
                          "or use tokenizer='byte'")
    roots = corpus_roots(cfg)
    files = list_files(roots)
    if not files:
        raise FileNotFoundError(f"no *.py files under {', '.join(map(str, roots.values()))}")
    sizes = [p.stat().st_size for _, p in files]
    fp = fingerprint(files, sizes, cfg)
    cache = Path(cache_dir) / fp
    meta_path = cache / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        log(f"data: cached {cache} ({meta['train_tokens']:,} train / {meta['val_tokens']:,} held-out tokens)")
    else:
        train_files, val_files = split_files(files, sizes, cfg)
        log(f"data: {len(train_files)} train / {len(val_files)} held-out files from "
            f"{', '.join(f'{k} ({v})' for k, v in roots.items())}; "
            f"tokenizer {cfg.tokenizer}" + (f" (vocab {cfg.vocab_size})" if cfg.tokenizer == "bpe" else ""))
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        train, val, vocab, eot = _tokenize(cfg, train_files, val_files, tmp)
        np.save(tmp / "train.npy", train)
        np.save(tmp / "val.npy", val)
        n_bytes = sum(p.stat().st_size for _, p in train_files + val_files)
        meta = {
            "fingerprint": fp, "config": asdict(cfg), "roots": {k: str(v) for k, v in roots.items()},
            "python": sys.version.split()[0], "torch": torch.__version__,
            "files": {"train": len(train_files), "val": len(val_files)},
            "val_files": [name for name, _ in val_files],
            "bytes": n_bytes, "train_tokens": int(train.size), "val_tokens": int(val.size),
            "bytes_per_token": n_bytes / max(1, train.size + val.size), "vocab_size": vocab, "eot": eot,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            tmp.rename(cache)
        except OSError:  # another process finished first: keep its copy
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()
        log(f"data: {meta['train_tokens']:,} train / {meta['val_tokens']:,} held-out tokens "
            f"({meta['bytes_per_token']:.2f} bytes/token) -> {cache}")
    train = torch.from_numpy(np.load(cache / "train.npy"))
    val = torch.from_numpy(np.load(cache / "val.npy"))
    return Corpus(train=train, val=val, vocab_size=meta["vocab_size"], meta=meta)
