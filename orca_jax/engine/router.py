"""Which data-parallel replica takes a request: the least loaded, unless one that holds the
request's prompt prefix is loaded about as lightly (SGLang's cache-aware routing).

Load is a replica's live requests (waiting plus running), counted by the caller when it routes
and when a request finishes, so a burst that arrives within one step still spreads.

The router keeps its own record of the prefixes it sent where: the page hashes of each routed
prompt (`orca_jax.core.prefix_cache.hash_page`, the engine's own keys for token prompts), each
mapped to the replicas it went to, least recently routed first out when the record is full. It
never asks a replica's cache, which lives on another thread and evicts on its own; the record
can therefore be wrong (a prefix evicted there since), and a wrong guess costs only a prefill
that a perfect one would have saved: routing decides where a request runs, never what it
computes. Text prompts (the offline API's) are hashed in blocks of characters instead, as the
router has no tokenizer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from orca_jax.core.prefix_cache import extend_page_hashes
from orca_jax.engine.request import split_prompt

# Characters per block of a text prompt: about a page of tokens at ~4 characters a token.
CHARS_PER_TOKEN = 4
DEFAULT_CAPACITY = 1 << 16  # page hashes remembered, across replicas (~100 bytes each)


@dataclass(frozen=True)
class Route:
    replica: int
    reason: str  # "least_loaded" or "prefix"
    matched_pages: int  # leading pages of the prompt the chosen replica was sent before
    pages: tuple[bytes, ...] = ()  # the prompt's page hashes, for `record`


class PrefixAffinityRouter:
    """`slack`: how many more live requests than the least loaded replica a replica holding a
    longer prefix may have and still be chosen for it."""

    def __init__(self, num_replicas: int, page_size: int, *, slack: int, capacity: int = DEFAULT_CAPACITY):
        if num_replicas < 1 or page_size < 1 or slack < 0 or capacity < 1:
            raise ValueError(f"bad router settings: {num_replicas} replicas, page_size {page_size}, "
                             f"slack {slack}, capacity {capacity}")
        self.num_replicas, self.page_size, self.slack, self.capacity = num_replicas, page_size, slack, capacity
        self._holders: OrderedDict[bytes, set[int]] = OrderedDict()  # page hash -> replicas sent it
        self._next = 0  # where the search for a least loaded replica starts: ties rotate

    def route(self, prompt, loads: Sequence[int]) -> Route:
        """Choose a replica for `prompt` (any of LLMEngine.add_request's forms) given each one's
        load. Nothing is remembered until the caller says where the request went (`record`):
        a replica that refuses it (a full queue, a bad prompt) never holds its prefix."""
        if len(loads) != self.num_replicas:
            raise ValueError(f"{len(loads)} loads for {self.num_replicas} replicas")
        pages = tuple(self.page_hashes(prompt))
        matched = self._matched_pages(pages)
        least = self._least_loaded(loads)
        # The longest match, the lighter of equals; taken only when it is about as light.
        holder = max(range(self.num_replicas), key=lambda r: (matched[r], -loads[r]))
        if matched[holder] > 0 and loads[holder] - loads[least] <= self.slack:
            return Route(holder, "prefix", matched[holder], pages)
        return Route(least, "least_loaded", matched[least], pages)

    def record(self, route: Route, replica: int | None = None) -> None:
        """The request of `route` was taken by `replica` (default: the one routed to)."""
        self._remember(route.pages, route.replica if replica is None else replica)

    def reset(self) -> None:
        """Forget every prefix (the replicas' caches were reset)."""
        self._holders.clear()

    def page_hashes(self, prompt) -> list[bytes]:
        """The chained hashes of the prompt's full pages (token ids), or of its full blocks of
        CHARS_PER_TOKEN x page_size characters (text). A malformed prompt hashes to nothing:
        the replica's engine refuses it with the reason."""
        try:
            body, salt = split_prompt(prompt)
        except Exception:  # noqa: BLE001 - the engine, not the router, explains a bad prompt
            return []
        if isinstance(body, str):
            block = CHARS_PER_TOKEN * self.page_size
            units, salt = [ord(c) for c in body], f"text:{salt or ''}"
        elif isinstance(body, Sequence) and all(isinstance(t, int) for t in body):
            block, units = self.page_size, list(body)
        else:
            return []
        return extend_page_hashes([], lambda start, stop: units[start:stop], len(units), block, salt)

    def _matched_pages(self, pages: Sequence[bytes]) -> list[int]:
        """Per replica, how many leading pages of `pages` were routed to it."""
        matched = [0] * self.num_replicas
        alive = set(range(self.num_replicas))
        for index, page in enumerate(pages):
            alive &= self._holders.get(page, set())
            if not alive:
                break
            for r in alive:
                matched[r] = index + 1
        return matched

    def _least_loaded(self, loads: Sequence[int]) -> int:
        lightest = min(loads)
        order = [(self._next + i) % self.num_replicas for i in range(self.num_replicas)]
        chosen = next(r for r in order if loads[r] == lightest)
        self._next = (chosen + 1) % self.num_replicas
        return chosen

    def _remember(self, pages: Sequence[bytes], replica: int) -> None:
        for page in pages:
            self._holders.setdefault(page, set()).add(replica)
            self._holders.move_to_end(page)
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)


def default_slack(max_num_seqs: int) -> int:
    """A quarter of a batch: a few requests more in a replica's queue cost less than prefilling a
    long shared prefix again, a whole batch more does not."""
    return max(1, max_num_seqs // 4)
