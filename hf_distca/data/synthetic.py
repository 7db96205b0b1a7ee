"""Synthetic documents for tests, benchmarks and smoke training, without downloading a data set.

Lengths are lognormal (long-tailed like real pretraining data: many short documents, a few long
ones) and clipped to [min, max]. The content has structure a tiny model learns within a few dozen
steps, so a falling loss shows that training works end to end:
- a shared "language": from token t the next token is t + o (mod the vocabulary) for one of four
  offsets o, drawn with probabilities 0.6 / 0.2 / 0.12 / 0.08 (a sparse bigram table: entropy
  ~1.1 nats against log(vocab) for uniform tokens);
- half of the documents instead repeat a short motif (4-32 tokens of that language) with 5% of
  the tokens replaced by noise, which rewards attending to earlier parts of the same document
  (across pieces, once a document is cut over ranks).
The language depends only on ``language_seed`` and the vocabulary, so train and eval sets drawn
with different ``seed`` values share it. Everything is deterministic in the seeds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["document_lengths", "documents_with_lengths", "generate_documents", "generate_text_documents"]

_OFFSET_PROBS = np.array([0.6, 0.2, 0.12, 0.08])
_MOTIF_FRACTION = 0.5
_MOTIF_LENGTHS = (4, 32)
_NOISE = 0.05
_SENTENCE_END = 0.08
_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def document_lengths(
    num_docs: int,
    *,
    seed: int,
    mean_length: int = 512,
    max_length: int = 8192,
    min_length: int = 16,
    length_sigma: float = 1.0,
) -> np.ndarray:
    """Lognormal document lengths (int64), mean ~``mean_length`` before clipping to [min, max]."""
    _check_lengths(num_docs, mean_length, max_length, min_length, length_sigma, "length")
    rng = np.random.default_rng(seed)
    return _lengths(rng, num_docs, mean_length, max_length, min_length, length_sigma)


def generate_documents(
    num_docs: int,
    *,
    vocab_size: int,
    seed: int,
    mean_length: int = 512,
    max_length: int = 8192,
    min_length: int = 16,
    length_sigma: float = 1.0,
    language_seed: int = 0,
) -> list[list[int]]:
    """``num_docs`` token-id documents with ids in [1, vocab_size) (0 is left for padding).

    ``length_sigma``: sigma of the log-length (larger: longer tail). ``language_seed``: seed of the
    shared next-token structure; ``seed``: lengths and sampling.
    """
    _check_lengths(num_docs, mean_length, max_length, min_length, length_sigma, "length")
    rng = np.random.default_rng(seed)
    lengths = _lengths(rng, num_docs, mean_length, max_length, min_length, length_sigma)
    return _documents(rng, lengths, vocab_size, language_seed)


def documents_with_lengths(
    lengths: Sequence[int], *, vocab_size: int, seed: int, language_seed: int = 0
) -> list[list[int]]:
    """Token-id documents of exactly the given lengths (e.g. drawn from a measured length sample)."""
    if any(int(n) < 1 for n in lengths):
        raise ValueError("document lengths must be >= 1")
    return _documents(np.random.default_rng(seed), lengths, vocab_size, language_seed)


def _documents(rng: np.random.Generator, lengths, vocab_size: int, language_seed: int) -> list[list[int]]:
    """Documents of the given lengths, token ids in [1, vocab_size) (checks vocab_size for every generator)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an int >= 2 (id 0 is reserved for padding), got {vocab_size!r}")
    modulus = vocab_size - 1
    offsets = _offsets(modulus, language_seed)
    return [(_content(rng, int(n), offsets, modulus) + 1).tolist() for n in lengths]


def generate_text_documents(
    num_docs: int,
    *,
    seed: int,
    mean_words: int = 256,
    max_words: int = 4096,
    min_words: int = 8,
    num_words: int = 2000,
    length_sigma: float = 1.0,
    language_seed: int = 0,
) -> list[str]:
    """``num_docs`` plain-text documents of pseudo-words (for the tokenizer path).

    Same structure as ``generate_documents`` over a vocabulary of ``num_words`` pseudo-words built
    from syllables, with sentence ends ('.') sprinkled in; lengths are counted in words.
    """
    _check_lengths(num_docs, mean_words, max_words, min_words, length_sigma, "words")
    if isinstance(num_words, bool) or not isinstance(num_words, int) or not 2 <= num_words <= 100_000:
        raise ValueError(f"num_words must be an int in [2, 100000], got {num_words!r}")
    words = _pseudo_words(num_words, language_seed)
    offsets = _offsets(num_words, language_seed)
    rng = np.random.default_rng(seed)
    lengths = _lengths(rng, num_docs, mean_words, max_words, min_words, length_sigma)
    docs = []
    for n in lengths:
        ids = _content(rng, int(n), offsets, num_words)
        ends = rng.random(len(ids)) < _SENTENCE_END
        ends[-1] = True
        docs.append(" ".join(words[i] + ("." if e else "") for i, e in zip(ids.tolist(), ends.tolist())))
    return docs


def _lengths(rng: np.random.Generator, n: int, mean: int, hi: int, lo: int, sigma: float) -> np.ndarray:
    # E[lognormal(mu, sigma)] = exp(mu + sigma^2 / 2)
    mu = np.log(mean) - sigma**2 / 2
    raw = rng.lognormal(mu, sigma, size=n)
    return np.clip(np.rint(raw), lo, hi).astype(np.int64)


def _offsets(modulus: int, language_seed: int) -> np.ndarray:
    rng = np.random.default_rng([language_seed, modulus])
    if modulus <= len(_OFFSET_PROBS):
        return np.arange(len(_OFFSET_PROBS)) % modulus
    return rng.choice(np.arange(1, modulus), size=len(_OFFSET_PROBS), replace=False)


def _walk(rng: np.random.Generator, n: int, offsets: np.ndarray, modulus: int) -> np.ndarray:
    """Markov walk x[t+1] = x[t] + offsets[c_t] (mod modulus): a cumulative sum, so no Python loop."""
    steps = offsets[rng.choice(len(offsets), size=n - 1, p=_OFFSET_PROBS)] if n > 1 else np.zeros(0, np.int64)
    start = rng.integers(modulus)
    return (start + np.concatenate([[0], np.cumsum(steps)])) % modulus


def _content(rng: np.random.Generator, n: int, offsets: np.ndarray, modulus: int) -> np.ndarray:
    """Ids in [0, modulus): a walk of the language, or a noisy repeated motif of it."""
    if rng.random() < _MOTIF_FRACTION:
        motif = _walk(rng, int(rng.integers(_MOTIF_LENGTHS[0], _MOTIF_LENGTHS[1] + 1)), offsets, modulus)
        ids = np.resize(motif, n)
        noisy = rng.random(n) < _NOISE
        ids[noisy] = rng.integers(modulus, size=int(noisy.sum()))
        return ids.astype(np.int64)
    return _walk(rng, n, offsets, modulus).astype(np.int64)


def _pseudo_words(count: int, language_seed: int) -> list[str]:
    """``count`` distinct pronounceable words of 1-3 syllables, fixed by ``language_seed``."""
    rng = np.random.default_rng([language_seed, count, 7])
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < count:
        syllables = rng.integers(len(_SYLLABLES), size=int(rng.integers(1, 4)))
        word = "".join(_SYLLABLES[s] for s in syllables)
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def _check_lengths(num_docs: int, mean: int, hi: int, lo: int, sigma: float, unit: str) -> None:
    if isinstance(num_docs, bool) or not isinstance(num_docs, int) or num_docs < 0:
        raise ValueError(f"num_docs must be an int >= 0, got {num_docs!r}")
    if not 1 <= lo <= mean <= hi:
        raise ValueError(
            f"need 1 <= min_{unit} <= mean_{unit} <= max_{unit}, got min={lo}, mean={mean}, max={hi}"
        )
    if not sigma > 0:
        raise ValueError(f"length_sigma must be > 0, got {sigma!r}")
