"""The corpus: documents, their train / held-out split, tokens, and n-gram baselines.

Default source: every Python source and text file (``*.py``, ``*.pyi``, ``*.txt``, ``*.md``,
``*.rst``) of the running Python installation, its standard library and site-packages, read as
UTF-8 (files that are not, or that hold NUL bytes, are skipped), deduplicated by content (the
first name in sorted order kept). ``--data PATH`` takes a text file, a folder of text files, or a
JSON-lines file (``.jsonl``) whose lines carry a ``"text"`` field; each file or line is one document.

Documents are split by a hash of their name (stable across machines and runs): a document is
held out when its hash falls under ``heldout_frac``. Tokens: raw UTF-8 bytes (``"byte"``, the
default: nothing to train, and a 320-entry head that stays small next to a 1M-parameter model)
or a byte-level BPE trained on the train split (``"bpe"``, needs ``tokenizers``). Documents are
joined with an end-of-text token. Token arrays and ``meta.json`` are cached under
``<out>/data/<fingerprint>/``; the fingerprint covers the settings, every document's name and
size, and the Python version.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

EOT = "<|endoftext|>"
TOKENIZERS = ("byte", "bpe")
TEXT_SUFFIXES = (".py", ".pyi", ".txt", ".md", ".rst")
SKIP_DIRS = {"__pycache__", ".git"}


@dataclass(frozen=True)
class DataConfig:
    """Which documents, split and tokenizer.

    Attributes:
        path: a text file, a folder, or a ``.jsonl`` file; None for the Python installation.
        tokenizer: ``"byte"`` or ``"bpe"``.
        vocab_size: the BPE's vocabulary, end-of-text included (``"byte"``: 257 ids).
        heldout_frac: share of documents held out.
        max_bytes: keep only documents, in hash order, up to this many bytes (tests, quick looks).
        seed: salts the hash that splits and orders the documents.
        bpe_train_bytes: the BPE is trained on at most this many bytes of train documents.
    """

    path: str | None = None
    tokenizer: str = "byte"
    vocab_size: int = 4096
    heldout_frac: float = 0.02
    max_bytes: int | None = None
    seed: int = 0
    bpe_train_bytes: int = 50_000_000

    def __post_init__(self):
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {self.tokenizer!r}")
        if not 0.0 < self.heldout_frac < 1.0:
            raise ValueError(f"heldout_frac must be in (0, 1), got {self.heldout_frac}")
        if self.tokenizer == "bpe" and self.vocab_size < 257:
            raise ValueError(f"vocab_size must be >= 257 for a byte-level BPE, got {self.vocab_size}")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {self.max_bytes}")


@dataclass
class Corpus:
    """Token ids of the train and held-out splits (numpy int16/int32) and what made them."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    meta: dict


def bpe_available() -> bool:
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return False
    return True


def python_roots() -> dict[str, Path]:
    """``{label: folder}``: the standard library and every distinct site-packages folder."""
    paths = sysconfig.get_paths()
    roots = {"stdlib": Path(paths["stdlib"])}
    for key in ("purelib", "platlib"):
        p = Path(paths[key])
        if p.is_dir() and p.resolve() not in {r.resolve() for r in roots.values()}:
            roots["site-packages" if key == "purelib" else "platlib"] = p
    return roots


def _walk(root: Path, skip: set[Path]):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and Path(dirpath, d) not in skip)
        for f in filenames:
            if f.endswith(TEXT_SUFFIXES) or f.endswith(".jsonl"):
                yield Path(dirpath, f)


def list_sources(cfg: DataConfig) -> list[tuple[str, Path]]:
    """``(name, path)`` of every candidate file, sorted by name. The standard library's walk skips
    the site-packages folders inside it (listed under their own label)."""
    if cfg.path is not None:
        root = Path(cfg.path)
        if not root.exists():
            raise FileNotFoundError(f"--data {cfg.path}: no such file or folder")
        if root.is_file():
            return [(root.name, root)]
        return sorted((p.relative_to(root).as_posix(), p) for p in _walk(root, set()) if p.is_file())
    roots = python_roots()
    # (in a virtual environment the base interpreter's own site-packages sits inside the standard
    # library's folder without being a root: its packages are not the standard library)
    others = {p for p in roots.values()} | {roots["stdlib"] / d for d in ("site-packages", "dist-packages")}
    files = []
    for label, root in roots.items():
        for p in _walk(root, others - {root}):
            if not p.name.endswith(".jsonl") and p.is_file():
                files.append((f"{label}/{p.relative_to(root).as_posix()}", p))
    return sorted(files)


def _name_hash(name: str, seed: int) -> float:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def _documents(files: list[tuple[str, Path]]) -> tuple[list[tuple[str, bytes]], int]:
    """``(name, utf-8 bytes)`` of every document, and how many files were skipped as not UTF-8
    text: a JSON-lines file gives one document per line with a ``"text"``, other files one each."""
    docs, skipped = [], 0
    for name, path in files:
        raw = path.read_bytes()
        if name.endswith(".jsonl"):
            for i, line in enumerate(raw.splitlines()):
                text = json.loads(line).get("text") if line.strip() else None
                if isinstance(text, str) and text:
                    docs.append((f"{name}:{i}", text.encode("utf-8")))
            continue
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        if b"\x00" in raw:
            skipped += 1
        elif raw:
            docs.append((name, raw))
    return docs, skipped


def collect(cfg: DataConfig, files: list[tuple[str, Path]]):
    """Deduplicated documents, split: ``(train, held_out, stats)``, each a list of ``(name, bytes)``
    in hash order (``max_bytes`` keeps a prefix of that order)."""
    found, skipped = _documents(files)
    seen, docs, dupes = set(), [], 0
    for name, raw in found:
        digest = hashlib.blake2b(raw, digest_size=16).digest()
        if digest in seen:
            dupes += 1
            continue
        seen.add(digest)
        docs.append((name, raw))
    docs.sort(key=lambda d: _name_hash(d[0], cfg.seed))
    if cfg.max_bytes is not None:
        kept, total = [], 0
        for d in docs:
            if total + len(d[1]) > cfg.max_bytes:
                continue
            kept.append(d)
            total += len(d[1])
        docs = kept
    val = [d for d in docs if _name_hash("heldout/" + d[0], cfg.seed) < cfg.heldout_frac]
    train = [d for d in docs if _name_hash("heldout/" + d[0], cfg.seed) >= cfg.heldout_frac]
    if not val:  # a small corpus: hold out its first document
        val, train = train[:1], train[1:]
    if not train:
        raise ValueError(f"too few documents ({len(docs)}) to hold out {cfg.heldout_frac:.0%} and train on the rest")
    stats = {"documents": len(docs), "duplicates_dropped": dupes, "skipped_not_text": skipped}
    return train, val, stats


def fingerprint(cfg: DataConfig, files: list[tuple[str, Path]]) -> str:
    h = hashlib.sha256(json.dumps({"cfg": asdict(cfg), "python": sys.version.split()[0]}).encode())
    for name, path in files:
        h.update(f"{name}:{path.stat().st_size}\n".encode())
    return h.hexdigest()[:16]


def folders(files: list[tuple[str, Path]]) -> dict[str, list[int]]:
    """``{folder: [files, bytes]}`` of the candidate files, by the first folder under each root
    (``site-packages/torch``; a root's own files as ``stdlib/*``): what tells two machines'
    corpora apart when their fingerprints differ."""
    out: dict[str, list[int]] = {}
    for name, path in files:
        parts = name.split("/")
        head = "/".join(parts[:2]) if len(parts) > 2 else f"{parts[0]}/*" if len(parts) == 2 else "*"
        entry = out.setdefault(head, [0, 0])
        entry[0] += 1
        entry[1] += path.stat().st_size
    return dict(sorted(out.items()))


def difference(saved: dict, here: dict) -> str:
    """How the corpus of ``saved`` (a ``meta.json``) differs from ``here``'s, in a phrase: the folders
    one has and the other lacks or holds otherwise where both records list them, else the counts."""
    if saved.get("folders") is not None and here.get("folders") is not None:
        a, b = saved["folders"], here["folders"]
        changes = [f"{k} only there ({a[k][0]:,} files)" for k in a if k not in b]
        changes += [f"{k} only here ({b[k][0]:,} files)" for k in b if k not in a]
        changes += [f"{k} differs ({a[k][0]:,} files, {a[k][1]:,} bytes there; {b[k][0]:,}, {b[k][1]:,} here)"
                    for k in a if k in b and a[k] != b[k]]
        if changes:
            return "; ".join(changes[:8]) + (f"; and {len(changes) - 8} more" if len(changes) > 8 else "")
    docs = here.get("documents", 0) - saved.get("documents", 0)
    size = _bytes(here) - _bytes(saved)
    return (f"{saved.get('documents', 0):,} documents, {_bytes(saved):,} bytes, Python {saved.get('python')} there; "
            f"{here.get('documents', 0):,}, {_bytes(here):,}, Python {here.get('python')} here "
            f"({docs:+,} documents, {size:+,} bytes)")


def _bytes(meta: dict) -> int:
    return meta.get("train_bytes", 0) + meta.get("val_bytes", 0)


def estimate_bytes(cfg: DataConfig) -> tuple[int, int]:
    """(files, bytes) of the candidate files before deduplication: what ``--list`` can say without
    reading them."""
    files = list_sources(cfg)
    total = sum(p.stat().st_size for _, p in files)
    return len(files), min(total, cfg.max_bytes) if cfg.max_bytes else total


def _train_bpe(texts: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2 pre-tokenisation, all 256 bytes in the base alphabet)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _encode(cfg: DataConfig, train, val, cache: Path):
    """Token arrays (documents joined by end-of-text), the vocabulary and the end-of-text id."""
    if cfg.tokenizer == "byte":
        eot, vocab = 256, 257
        encode = lambda docs: [np.frombuffer(raw, dtype=np.uint8) for _, raw in docs]  # noqa: E731
    else:
        sample, total = [], 0
        for _, raw in train:
            if total >= cfg.bpe_train_bytes:
                break
            sample.append(raw.decode("utf-8"))
            total += len(raw)
        tok = _train_bpe(sample, cfg.vocab_size)
        tok.save(str(cache / "tokenizer.json"))
        eot, vocab = tok.token_to_id(EOT), tok.get_vocab_size()
        encode = lambda docs: [np.asarray(e.ids, dtype=np.int32)  # noqa: E731
                               for e in tok.encode_batch_fast([raw.decode("utf-8") for _, raw in docs])]
    dtype = np.int16 if vocab <= 2**15 else np.int32

    def join(docs):
        parts = encode(docs)
        out = np.empty(sum(len(p) + 1 for p in parts), dtype=dtype)
        at = 0
        for p in parts:
            out[at: at + len(p)] = p
            out[at + len(p)] = eot
            at += len(p) + 1
        return out
    return join(train), join(val), vocab, eot


def prepare(cfg: DataConfig, cache_dir, log=print) -> Corpus:
    """Build (or load from ``cache_dir``) the tokenized corpus of ``cfg``."""
    if cfg.tokenizer == "bpe" and not bpe_available():
        raise ImportError("tokenizer 'bpe' needs the `tokenizers` package (pip install tokenizers); "
                          "or use the byte tokenizer")
    files = list_sources(cfg)
    if not files:
        raise FileNotFoundError(f"no text files found ({cfg.path or 'Python installation'})")
    fp = fingerprint(cfg, files)
    cache = Path(cache_dir) / fp
    if not all((cache / f).exists() for f in ("meta.json", "train.npy", "val.npy")):
        train, val, stats = collect(cfg, files)
        tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        train_ids, val_ids, vocab, eot = _encode(cfg, train, val, tmp)
        np.save(tmp / "train.npy", train_ids)
        np.save(tmp / "val.npy", val_ids)
        train_bytes, val_bytes = sum(len(r) for _, r in train), sum(len(r) for _, r in val)
        meta = {
            "fingerprint": fp, "config": asdict(cfg), "python": sys.version.split()[0],
            "source": cfg.path or {k: str(v) for k, v in python_roots().items()}, "folders": folders(files),
            **stats, "train_documents": len(train), "val_documents": len(val),
            "train_bytes": train_bytes, "val_bytes": val_bytes,
            "train_tokens": int(train_ids.size), "val_tokens": int(val_ids.size),
            "val_tokens_per_byte": val_ids.size / val_bytes, "vocab_size": vocab, "eot": eot,
            "baselines": ngram_baselines(train_ids, val_ids, vocab),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if cache.exists():  # an incomplete copy (a description without its tokens): replaced
            shutil.rmtree(cache)
        try:
            tmp.rename(cache)
        except OSError:  # another process finished first: keep its copy
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()
    meta = json.loads((cache / "meta.json").read_text())
    log(f"data: {meta['train_tokens']:,} train / {meta['val_tokens']:,} held-out tokens "
        f"({meta['train_documents']:,} / {meta['val_documents']:,} documents, {meta['duplicates_dropped']:,} "
        f"duplicates dropped; {meta['config']['tokenizer']} tokens) -> {cache}")
    return Corpus(train=np.load(cache / "train.npy"), val=np.load(cache / "val.npy"), vocab_size=meta["vocab_size"],
                  meta=meta)


def ngram_baselines(train: np.ndarray, val: np.ndarray, vocab: int, chunk: int = 1 << 24) -> dict:
    """Held-out cross-entropy (nats/token) of a unigram and a bigram model counted on the train
    split: unigram with add-one smoothing; bigram ``(c(a, b) + mu·p(b)) / (c(a) + mu)`` with the
    prior strength ``mu`` picked from a grid on the held-out split itself (a generous baseline)."""
    bigram = vocab <= 8192  # else a [V, V] table would not fit: unigram only
    uni = np.zeros(vocab, dtype=np.float64)
    pairs = np.zeros(vocab * vocab if bigram else 1, dtype=np.float64)
    for at in range(0, train.size, chunk):  # in chunks: int64 copies of the whole split would not fit
        a = train[at: at + chunk + 1].astype(np.int64)
        uni += np.bincount(a[: chunk], minlength=vocab)
        if bigram:
            pairs += np.bincount(a[:-1] * vocab + a[1:], minlength=vocab * vocab)
    p_uni = (uni + 1.0) / (uni.sum() + vocab)
    nll_uni = float(-np.log(p_uni[val.astype(np.int64)]).mean())
    if not bigram:
        return {"unigram": nll_uni, "bigram": None, "bigram_mu": None}
    pairs = pairs.reshape(vocab, vocab)
    prev, nxt = val[:-1].astype(np.int64), val[1:].astype(np.int64)
    c_ab, c_a = pairs[prev, nxt], pairs.sum(1)[prev]
    best = None
    for mu in (0.1, 1.0, 10.0, 100.0, 1000.0):
        nll = float(-np.log((c_ab + mu * p_uni[nxt]) / (c_a + mu)).mean())
        if best is None or nll < best[0]:
            best = (nll, mu)
    return {"unigram": nll_uni, "bigram": best[0], "bigram_mu": best[1]}


def bits_per_byte(nats_per_token: float, tokens_per_byte: float) -> float:
    return nats_per_token * tokens_per_byte / math.log(2)
