"""Constrained decoding with llguidance: a request's StructuredOutputsParams become a grammar,
each constrained sequence gets a matcher, and each step gets one token bitmask.

    GrammarCompiler.validate(params)   grammar text, or RequestError naming the field (before
                                       anything is queued: it parses the grammar, ~1 ms)
    GrammarCompiler.compile(params)    a Future of a ready matcher template, built on the
                                       compiler's own thread and cached per constraint, so a
                                       slow compile (the first one also wraps the tokenizer,
                                       ~1 s) stalls only the requests that wait for it
    GuidedState                        one sequence's matcher: advanced by every token the
                                       sequence appends (the engine's stop rule), never by a
                                       step's discarded token, and kept through preemption
    step_token_bitmask(scheduled, S, V)  the step's masked rows and its i32[S, ceil(V / 32)]
                                       allowed-token bitmask (bit v of word v // 32 is token v),
                                       all ones for free rows; the matchers' masks are
                                       computed in parallel, in Rust (fill_token_bitmask), then
                                       the token rules of orca_jax.structured.token_rules
                                       (allowed_token_ids, bad_words, min_tokens) applied

The step program masks the logits of the rows flagged guided (orca_jax.worker.sampling), so one
compiled program serves every mix of constrained and free rows.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from orca_jax.errors import RequestError
from orca_jax.structured.structured_outputs import StructuredOutputsParams

# Compiled grammars kept (each a matcher template of a few hundred KB at most).
GRAMMAR_CACHE_SIZE = 128
ALL_ALLOWED = -1  # an int32 word with every bit set


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


@functools.cache
def _llguidance():
    """Imported on first use: an engine that never constrains a request never loads it."""
    import llguidance
    import llguidance.numpy
    return llguidance


@functools.cache
def mask_executor():
    """llguidance's Rust thread pool that computes several matchers' masks at once (one per
    process: it is a pool of the machine's cores, like XLA's)."""
    return _llguidance().LLExecutor()


def _json_options(params: StructuredOutputsParams) -> dict:
    if params.disable_any_whitespace:
        return {"whitespace_flexible": False, "key_separator": ":", "item_separator": ","}
    return {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar definition of a constraint (not yet checked)."""
    llg = _llguidance()
    kind = params.kind
    if kind in ("json", "json_object"):
        return llg.LLMatcher.grammar_from_json_schema(params.json_schema(), defaults=_json_options(params))
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        # As one regex (a lexer-level automaton), not a grammar rule with an alternative per
        # choice: llguidance's parser allows 2,000 items in a row, and a longer choice list
        # would end the output after its first token.
        return llg.LLMatcher.grammar_from_regex(choice_regex(params.choice))
    return llg.grammar_from("grammar", params.grammar)  # Lark or GBNF


def choice_regex(choices) -> str:
    """A regex matching exactly the given strings, built as their prefix trie so that shared
    prefixes are spelled once ("cat", "car" -> "ca(?:r|t)")."""
    trie: dict = {}
    for choice in choices:
        node = trie
        for ch in choice:
            node = node.setdefault(ch, {})
        node[None] = {}  # a choice ends here

    def pattern(node: dict) -> str:
        # A chain of single-child nodes is one literal: spelled in a loop, not by recursion.
        literal = []
        while len(node) == 1 and None not in node:
            (ch, node), = node.items()
            literal.append(_escape(ch))
        ends_here = None in node
        branches = [_escape(ch) + pattern(child) for ch, child in sorted(node.items(), key=lambda kv: kv[0] or "")
                    if ch is not None]
        if not branches:
            return "".join(literal)
        group = branches[0] if len(branches) == 1 and not ends_here else "(?:" + "|".join(branches) + ")"
        return "".join(literal) + group + ("?" if ends_here else "")

    return pattern(trie)


_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def _escape(ch: str) -> str:
    """One character as a regex literal: only metacharacters are escaped (Rust's regex
    syntax, which llguidance follows, refuses escapes of ordinary characters)."""
    return "\\" + ch if ch in _REGEX_META else ch


def checked_grammar_text(params: StructuredOutputsParams, llg_tokenizer=None) -> str:
    """The constraint's grammar text, parsed and checked (~1 ms); RequestError naming the
    constraint's field if llguidance cannot enforce it. With the vocabulary (`llg_tokenizer`)
    the check also covers what a grammar says about tokens (ids, special tokens)."""
    try:
        text = grammar_text(params)
        error = _llguidance().LLMatcher.validate_grammar(text, llg_tokenizer)
    except (ValueError, TypeError, RuntimeError) as exc:
        error = str(exc)
    if error:
        raise RequestError(f"invalid {params.kind}: {_first_lines(error)}", params.field)
    return text


class GuidedState:
    """One constrained sequence's grammar state. `matcher` is None until its grammar has been
    compiled (the scheduler does not admit the sequence before)."""

    __slots__ = ("matcher", "num_consumed", "mask_words", "waits_for", "_recent")

    def __init__(self, starts_after: tuple[int, ...] | None = None):
        self.matcher = None
        self.num_consumed = 0  # output tokens seen (the matcher takes those after starts_after)
        self.mask_words = 0  # int32 words of the matcher's mask (its vocabulary / 32)
        # StructuredOutputsParams.starts_after as token ids: until the output ends with them the
        # grammar sleeps (masks nothing, takes no token); None: it is awake.
        self.waits_for = tuple(starts_after) if starts_after else None
        self._recent: tuple[int, ...] = ()

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    @property
    def dormant(self) -> bool:
        return self.waits_for is not None

    def accept(self, token: int) -> bool:
        """Advance by a token the sequence appended; False if the grammar refuses it."""
        self.num_consumed += 1
        if self.waits_for is not None:
            self._recent = (self._recent + (token,))[-len(self.waits_for):]
            if self._recent == self.waits_for:
                self.waits_for = None  # the constraint starts with the next token
            return True
        return bool(self.matcher.consume_token(token))

    @property
    def finished(self) -> bool:
        """Nothing but the end can follow (the grammar is complete)."""
        return not self.dormant and bool(self.matcher.is_stopped()) and not self.failed

    @property
    def failed(self) -> bool:
        """The matcher gave up (a limit of its parser passed): the output so far does not
        satisfy the constraint, and no further token can be checked."""
        return not self.dormant and bool(self.matcher.is_error())

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class GrammarCompiler:
    """Grammars for one tokenizer: validated and compiled off the step loop, cached per
    constraint. `eos_token_ids` end a complete grammar (the model's EOS ids)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._llg_tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiled: OrderedDict[str, Future] = OrderedDict()
        self._texts: OrderedDict[str, str] = OrderedDict()

    def validate(self, params: StructuredOutputsParams) -> str:
        """The constraint's grammar text; RequestError naming the constraint's field if the
        schema, regex or grammar is not one llguidance can enforce."""
        key = params.cache_key()
        if key in self._texts:
            self._texts.move_to_end(key)
            return self._texts[key]
        # The vocabulary only once it is built: building it here would stall the caller's loop.
        text = checked_grammar_text(params, self._llg_tokenizer)
        _remember(self._texts, key, text)
        return text

    def compile(self, params: StructuredOutputsParams) -> Future:
        """A Future of the constraint's matcher template (validate first). The same constraint
        compiles once; a failed compile is not cached."""
        key = params.cache_key()
        future = self._compiled.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._compiled.move_to_end(key)
            return future
        future = self._pool.submit(self._build, self.validate(params))
        _remember(self._compiled, key, future)
        return future

    def _build(self, text: str):
        llg = _llguidance()
        matcher = llg.LLMatcher(self.llg_tokenizer(), text, log_level=0)
        if matcher.is_error():
            raise RequestError(f"the grammar could not be compiled: {_first_lines(matcher.get_error())}")
        matcher.compute_bitmask()  # the first mask builds the lexer's tables, here rather than in a step
        return matcher

    def prepare_in_background(self) -> None:
        """Build the vocabulary on the compiler's thread now (a server at start), so that the
        first constrained request neither waits for it nor skips the vocabulary checks."""
        self._pool.submit(self.llg_tokenizer)

    def llg_tokenizer(self):
        """llguidance's view of the vocabulary (built once, ~1 s for 49k tokens)."""
        with self._tokenizer_lock:
            if self._llg_tokenizer is None:
                self._llg_tokenizer = llg_tokenizer_of(self._hf_tokenizer, max(self.vocab_size, len(self._hf_tokenizer)),
                                                       self._eos)
            return self._llg_tokenizer

    def start(self, state: GuidedState, template) -> None:
        """Give a sequence its own matcher, a copy of the compiled template (microseconds)."""
        state.matcher = template.deep_copy()
        state.mask_words = bitmask_words(self.llg_tokenizer().vocab_size)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def llg_tokenizer_of(tokenizer, n_vocab: int, eos_token_ids: list[int]):
    """llguidance's tokenizer over the Rust tokenizer's JSON, as `llguidance.hf.from_tokenizer`
    builds it (a copy without padding or truncation), but for any tokenizer that has a
    `backend_tokenizer` (orca_jax's own too): llguidance.hf imports transformers. A tokenizer
    without one (a slow transformers tokenizer) goes through llguidance.hf, which refuses it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        import llguidance.hf

        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=eos_token_ids)
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return _llguidance().LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos_token_ids)


def fill_token_bitmask(rows: list[tuple[int, GuidedState]], num_rows: int, vocab_size: int) -> np.ndarray:
    """The step's bitmask, i32[num_rows, ceil(vocab_size / 32)]: the allowed next tokens of
    each (row, state), every bit set elsewhere. The masks are computed in parallel in Rust."""
    words = bitmask_words(vocab_size)
    mask = np.full((num_rows, words), ALL_ALLOWED, np.int32)
    # llguidance writes a row as wide as its vocabulary: a tokenizer with more entries than the
    # model has logits gets a wider scratch, cut to the logits' width.
    llg_words = rows[0][1].mask_words
    scratch = mask if llg_words == words else np.full((num_rows, llg_words), ALL_ALLOWED, np.int32)
    matchers = [(state.matcher, row) for row, state in rows]
    _llguidance().numpy.fill_next_token_bitmask_par(mask_executor(), matchers, scratch)
    if scratch is not mask:
        mask[:, :] = scratch[:, :words]
    return mask


def step_token_bitmask(scheduled, num_rows: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A step's (masked bool[num_rows], token_bitmask i32[num_rows, W]) for a ScheduledBatch: a
    row is masked when it samples for a constrained sequence, or for one whose token rules
    (orca_jax.structured.token_rules) are in force at this token. Without masked rows the
    bitmask is a shared read-only all-ones array."""
    masked = np.zeros(num_rows, bool)
    grammar_rows, rule_rows = [], []
    for row, (seq, samples_now) in enumerate(zip(scheduled.seqs, scheduled.samples)):
        if not samples_now or (seq.guided is None and seq.token_rules is None):
            continue
        # Tokens sampled by earlier steps and not yet on the host (schedule() counted this
        # row's own): a matcher, or a rule that reads the output, would be behind the device.
        earlier_pending = seq.num_pending - scheduled.pending_counted
        num_output = len(seq.output_token_ids) + earlier_pending
        if seq.needs_host_tokens and (earlier_pending or (seq.guided is not None
                                                           and seq.guided.num_consumed != len(seq.output_token_ids))):
            raise RuntimeError(f"sequence {seq.seq_id}: its mask is behind its tokens (a sequence whose mask reads "
                               "its output was scheduled while its last token was still on the device)")
        if seq.guided is not None and not seq.guided.dormant:
            grammar_rows.append((row, seq.guided))
            masked[row] = True
        if seq.token_rules is not None and seq.token_rules.in_force(num_output):
            rule_rows.append((row, seq, num_output))
            masked[row] = True
    if not masked.any():
        return masked, all_allowed_bitmask(num_rows, vocab_size)
    mask = (fill_token_bitmask(grammar_rows, num_rows, vocab_size) if grammar_rows
            else np.full((num_rows, bitmask_words(vocab_size)), ALL_ALLOWED, np.int32))
    for row, seq, num_output in rule_rows:
        seq.token_rules.apply(mask[row], seq.output_token_ids, num_output)
    return masked, mask


@functools.lru_cache(maxsize=32)
def all_allowed_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    mask = np.full((num_rows, bitmask_words(vocab_size)), ALL_ALLOWED, np.int32)
    mask.flags.writeable = False  # shared by every step of this shape
    return mask


def _remember(cache: OrderedDict, key: str, value) -> None:
    cache[key] = value
    if len(cache) > GRAMMAR_CACHE_SIZE:
        cache.popitem(last=False)


def _first_lines(message: str, limit: int = 400) -> str:
    """llguidance's errors can carry its whole parser state; the client needs the cause."""
    text = message.split("\n<state>")[0].strip()
    return text if len(text) <= limit else text[:limit] + "..."
