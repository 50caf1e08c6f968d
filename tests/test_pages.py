"""The page pool's bookkeeping (runtime/cache/pages.py): prefix keys, reuse, reference counts, eviction."""

import numpy as np
import pytest

from k2trt.errors import K2Error
from k2trt.runtime.cache.pages import PagePool, cache_rows, page_keys, pages_for


def prefill(pool: PagePool, tokens: list[int]) -> list[int]:
    """What the scheduler does for a prompt: reuse the longest published prefix, take pages for the rest, and
    publish each full page once its latents are written."""
    hit = pool.match(tokens)
    table = hit + pool.allocate(pages_for(len(tokens), pool.page_tokens) - len(hit))
    keys = page_keys(tokens, pool.page_tokens)
    pool.publish(table, keys, len(keys))
    return table


def test_a_page_key_names_everything_before_it():
    a, b = list(range(8)), [9] + list(range(1, 8))
    ka, kb = page_keys(a, 4), page_keys(b, 4)
    assert len(ka) == 2 and ka[1] != kb[1]  # same second page, different first: not the same prefix
    assert page_keys(a + [1, 2], 4) == ka  # a partial page has no key
    assert page_keys(a[:4], 4) == ka[:1]


def test_the_longest_published_prefix_is_reused_and_the_last_prompt_token_always_computed():
    pool = PagePool(8, 4)
    first = prefill(pool, list(range(10)))  # two full pages published, one partial
    again = pool.match(list(range(10)))
    assert again == first[:2] and [pool.refs[p] for p in first] == [2, 2, 1]
    # exactly two pages of prompt: only the first is reused, the second holds the last token
    assert pool.match(list(range(8))) == first[:1]
    assert pool.match([5] + list(range(1, 10))) == []  # differs at the first token: nothing in common


def test_pages_nobody_references_stay_reusable_until_evicted_least_recently_used_first():
    pool = PagePool(4, 4)
    a = prefill(pool, list(range(8)))
    pool.release(a)
    assert pool.available == 4 and pool.in_use == 0
    b = prefill(pool, [7] * 8)  # takes the two free pages, not a's
    assert not set(a) & set(b)
    pool.release(b)
    assert pool.match(list(range(9))) == a  # a was used last: b's pages are now the oldest idle ones
    taken = pool.allocate(2)
    assert set(taken) == set(b) and pool.match([7] * 9) == []  # evicted and unpublished
    assert pool.allocate(1) is None  # a's pages are referenced again: never evicted under a reader


def test_allocation_takes_nothing_when_it_cannot_take_everything():
    pool = PagePool(3, 4)
    assert pool.allocate(4) is None and pool.available == 3
    table = pool.allocate(3)
    pool.release(table)
    with pytest.raises(K2Error, match="released more often"):
        pool.release(table[:1])


def test_without_the_prefix_cache_nothing_is_published_or_reused():
    pool = PagePool(4, 4, prefix_cache=False)
    a = prefill(pool, list(range(8)))
    pool.release(a)
    assert pool.match(list(range(9))) == [] and sum(map(len, pool.free)) == 4


def test_positions_map_through_the_page_table():
    rows = cache_rows([5, 2], np.arange(8), 4)
    assert rows.tolist() == [20, 21, 22, 23, 8, 9, 10, 11]
    with pytest.raises(K2Error, match="past the 2 pages"):
        cache_rows([5, 2], np.array([8]), 4)
