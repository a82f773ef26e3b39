"""Streaming packing resumes exactly once: pack_stream's state_dict / load_state_dict,
PackedIterable behind a DataLoader with 0 and 2 workers and torchdata's StatefulDataLoader, a world-size
change at the resume, a killed process, and every kind of damaged state refused by name.

The contract: on the same shards (ranks x workers) a resumed stream gives the rows the uninterrupted
stream would have given, bit for bit; on another number of shards every example (every piece of a split
one) is packed exactly once, in other windows. Checked on the multiset of ``(example, piece tokens)``.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from packkit.errors import DataError
from packkit.packer import STREAM_STATE_VERSION, pack_stream
from packkit.states import StateError

from testlib import gloo_group, thorough

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = ROOT / "benchmarks" / "data" / "sharegpt_qwen3_lengths.npy"


def make_examples(lengths, *, seed=0, labels=False, packed_every=0):
    """Examples of ``lengths`` tokens (int32 arrays, so a resume must keep the dtype); with ``labels`` a
    labels list; every ``packed_every``-th one a packed row of two documents (``seq_lengths``)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = rng.integers(0, 1000, int(n)).astype(np.int32)
        ex = {"input_ids": ids}
        if labels:
            ex["labels"] = (ids + 1).tolist()
        if packed_every and i % packed_every == 0 and n >= 2:
            ex["seq_lengths"] = [1, int(n) - 1]
        out.append(ex)
    return out


def pieces(rows) -> list:
    """Sorted ``(example, piece tokens)`` of packed rows: what exactly-once compares."""
    out = []
    for r in rows:
        off = 0
        for e, n in zip(r["example_ids"].tolist(), r["seq_lengths"].tolist()):
            out.append((e, r["input_ids"][off: off + n].tobytes()))
            off += n
    return sorted(out)


def row_mismatch(a: list, b: list) -> str | None:
    """Where rows ``a`` first differ from rows ``b`` (count, columns, dtype or values); None when equal."""
    if len(a) != len(b):
        return f"{len(a)} rows against {len(b)}"
    for k, (x, y) in enumerate(zip(a, b)):
        if x.keys() != y.keys():
            return f"row {k}: columns {sorted(x)} against {sorted(y)}"
        for c in x:
            if x[c].dtype != y[c].dtype or not np.array_equal(x[c], y[c]):
                return f"row {k}, column {c!r}: {x[c]} against {y[c]}"
    return None


def roundtrip(state):
    """What a checkpoint does to a state: JSON out and back (lists, str keys)."""
    return json.loads(json.dumps(state))


def run_with_stops(src, opts, rng, p_stop: float, *, json_every: int = 1):
    """The rows of ``src``, stopping after each row with probability ``p_stop``: a new stream resumes from
    the state (JSON round trip every ``json_every``-th stop). States are also taken without stopping.
    Returns rows, stops and the last stream."""
    stream = pack_stream(src, **opts)
    rows, stops = [], 0
    while True:
        try:
            rows.append(next(stream))
        except StopIteration:
            return rows, stops, stream
        if rng.random() < 0.5:  # a state taken and let go (torchdata takes one every step): the next
            stream.state_dict()  # state is brought up to date from it
        if rng.random() < p_stop:
            state = stream.state_dict()
            stops += 1
            stream = pack_stream(src, **opts)
            stream.load_state_dict(roundtrip(state) if stops % json_every == 0 else state)


# -- pack_stream on one shard: bit for bit ------------------------------------------------------------------


case = st.integers(1, 24).flatmap(lambda W: st.tuples(
    st.just(W), st.lists(st.one_of(st.integers(1, W), st.sampled_from([W, W + 1, 2 * W + 1, 3 * W])), max_size=40)))


@settings(max_examples=30)
@given(case, st.sampled_from(["split", "truncate", "drop"]), st.integers(1, 9), st.booleans(), st.integers(0, 2**32 - 1))
@example((1, []), "split", 1, False, 0)  # an empty stream: a state before the first row
@example((4, [9, 9, 1]), "split", 1, True, 1)  # pieces left to buffer at every stop (next fit)
@example((5, [5, 5, 5]), "drop", 2, False, 2)
def test_random_stops_give_the_uninterrupted_rows(c, overflow, buffer_size, labels, seed):
    window, lengths = c
    src = make_examples(lengths, seed=seed % 1000, labels=labels, packed_every=3)
    opts = dict(window=window, buffer_size=buffer_size, overflow=overflow, example_ids=True)
    full = list(pack_stream(src, **opts))
    rows, stops, last = run_with_stops(src, opts, np.random.default_rng(seed), 0.4)
    print(len(full), "rows", stops, "stops")
    assert row_mismatch(rows, full) is None
    ref = pack_stream(src, **opts)
    list(ref)
    assert last.stats == ref.stats  # the counts travel with the state


def test_many_random_stops_on_real_lengths():
    """ShareGPT lengths (Qwen3 tokens), W=2048, a buffer of 16: 100 stops on 1,000 examples under ci, 10,000 on all 17,509 under thorough,
    each a JSON round trip every 10th time; the rows equal the uninterrupted run's."""
    lengths = np.load(LENGTHS)
    n_stops = 10_000 if thorough() else 100
    n = lengths.size if thorough() else 1000
    src = make_examples(lengths[:n], seed=1)
    opts = dict(window=2048, buffer_size=16, overflow="split", example_ids=True)
    full = list(pack_stream(src, **opts))
    rng = np.random.default_rng(2)
    rows, stops, _ = run_with_stops(src, opts, rng, min(1.0, n_stops / len(full)), json_every=10)
    print(f"{n} examples, {len(full)} rows, {stops} stops")
    assert stops >= 0.8 * min(n_stops, len(full))
    assert row_mismatch(rows, full) is None


# -- another number of shards ---------------------------------------------------------------------------


def run_shards(src, opts, num_shards, states, rng, stop: bool):
    """Every shard of ``num_shards`` resumed from ``states`` (None: fresh); with ``stop`` each gives a random
    number of rows, then all states are taken. Returns (rows, states or None)."""
    streams = []
    for s in range(num_shards):
        stream = pack_stream(src, shard=s, num_shards=num_shards, **opts)
        if states is not None:
            stream.load_state_dict(roundtrip(states))
        streams.append(stream)
    rows = []
    for stream in streams:
        k = int(rng.integers(0, 12)) if stop else None
        for row in stream:
            rows.append(row)
            if k is not None and (k := k - 1) < 0:
                break
    return rows, ([s.state_dict() for s in streams] if stop else None)


@settings(max_examples=40)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), case, st.sampled_from(["split", "truncate"]),
       st.integers(1, 6), st.integers(0, 2**32 - 1))
@example([2, 3], (4, [9, 1, 2, 3, 4, 1]), "split", 2, 0)
@example([4, 1, 3], (3, [1] * 20), "split", 5, 1)
def test_a_change_of_shards_packs_every_example_once(chain, c, overflow, buffer_size, seed):
    """Ranks x workers change at every resume along ``chain`` (e.g. 2 -> 3): every piece once."""
    window, lengths = c
    src = make_examples(lengths, seed=seed % 1000, packed_every=4)
    opts = dict(window=window, buffer_size=buffer_size, overflow=overflow, example_ids=True)
    full = list(pack_stream(src, **opts))
    rng = np.random.default_rng(seed)
    rows, states = [], None
    for k, S in enumerate(chain):
        got, states = run_shards(src, opts, S, states, rng, stop=k < len(chain) - 1)
        rows += got
    assert pieces(rows) == pieces(full)


def test_same_shards_resume_bit_for_bit():
    """On the same shards, from its own state or from the list of all, each shard gives its own rows."""
    src = make_examples(np.random.default_rng(3).integers(1, 60, 300), seed=3)
    opts = dict(window=48, buffer_size=8, overflow="split", example_ids=True)
    rng = np.random.default_rng(4)
    for S in (2, 3):
        streams = [pack_stream(src, shard=s, num_shards=S, **opts) for s in range(S)]
        first = [[next(st) for _ in range(int(rng.integers(0, 30)))] for st in streams]
        states = [st.state_dict() for st in streams]
        for s in range(S):
            full = list(pack_stream(src, shard=s, num_shards=S, **opts))
            for saved in (states[s], states):
                again = pack_stream(src, shard=s, num_shards=S, **opts)
                again.load_state_dict(roundtrip(saved))
                assert row_mismatch(first[s] + list(again), full) is None


def test_a_state_after_every_row_holds_no_tokens_and_builds_each_entry_once(monkeypatch):
    """What a state costs when torchdata takes one every step. Version 1 held each buffered piece's tokens as
    base64: 11 us a 1,400-token piece, most of a state's cost (a state every 100 rows made pack_stream 1.45x
    the CPU of the revision before states). A state now holds a few integers a piece (where it is in the
    source and its CRC, taken once, by the first state that holds it); later states hand out the same entry
    objects; and each state is a dict of its own that later rows and states leave as it was taken (the stream
    keeps its entries between states, and rebuilds the dict it keeps once many pieces have left it:
    ``buffer_size=40`` and 1,200 examples go through that many times)."""
    from packkit import packer

    real, calls = packer._piece_check, []
    monkeypatch.setattr(packer, "_piece_check", lambda arrays, digest: calls.append(1) or real(arrays, digest))
    src = make_examples(np.load(LENGTHS)[:1200] // 16 + 1)
    stream = pack_stream(src, window=128, buffer_size=40, overflow="split", example_ids=True)
    entries, before = {}, None
    for _row in stream:
        state = stream.state_dict()
        for e in [*(e for group in state["buffer"].values() for e in group), *state["pending"]]:
            assert len(e) in (5, 6) and all(type(x) is int for x in e), e  # no tokens, whatever the piece's length
            entries[id(e)] = e  # kept alive, so that an id is never reused
        if before is not None:
            kept = state["buffer"].keys() & before[0]["buffer"].keys()
            for k in kept:  # a group that did not change is the same list; one that did holds the same entries
                new, old = state["buffer"][k], before[0]["buffer"][k]
                assert new is old or new != old, k
                assert {id(e) for e in new} & {id(e) for e in old} == {id(e) for e in new if e in old}
            assert sum(len(g) > 32 for g in state["buffer"].values()) == 0
            assert json.dumps(before[0]) == before[1]  # the last state as it was taken
        before = (state, json.dumps(state))
    assert len(entries) > len(src), len(entries)  # pieces of split examples too
    assert len(calls) == len(entries), (len(calls), len(entries))


# -- a saved state is input ---------------------------------------------------------------------------------

OPTS = dict(window=8, buffer_size=3, overflow="split", example_ids=True)
SRC = make_examples([3, 60, 5, 2, 7, 1, 8, 4, 6, 2, 3, 5], seed=5, labels=True)


def mid_stream():
    """A stream two rows in, with examples in its buffer and pieces still pending, and its state."""
    stream = pack_stream(SRC, **OPTS)
    next(stream), next(stream)
    state = stream.state_dict()
    assert state["buffer"] and state["pending"] and state["checks"], state
    return stream, state


def damaged():
    _, good = mid_stream()
    key = next(iter(good["buffer"]))
    item, *rest = good["buffer"][key]
    cases = [
        ("version", {"version": STREAM_STATE_VERSION + 1}), ("version", {"version": "1"}),
        ("version", {"version": None}), ("check", {"check": "md5"}), ("check", {"check": None}),
        ("window", {"window": 16}), ("buffer_size", {"buffer_size": 4}), ("overflow", {"overflow": "truncate"}),
        ("columns", {"columns": ["input_ids"]}), ("mask_first_label", {"mask_first_label": False}),
        ("example_ids", {"example_ids": False}), ("window", {"window": "8"}),
        ("read", {"read": ["input_ids"]}), ("read", {"read": "input_ids"}),
        ("num_shards", {"num_shards": 0}), ("num_shards", {"num_shards": 2.0}),
        ("shard", {"shard": -1}), ("shard", {"shard": 1}), ("start", {"start": -1}),
        ("position", {"position": -3}), ("position", {"position": "5"}),
        ("skip", {"skip": [4, 2]}), ("skip", {"skip": "none"}), ("skip", {"skip": [True]}),
        ("checks", {"checks": [[1]]}), ("checks", {"checks": [[1, -5]]}), ("checks", {"checks": [[99, 1]]}),
        ("checks", {"checks": {}}),
        ("buffer", {"buffer": []}), ("buffer", {"buffer": {"x": item}}),
    ] + [  # a piece: example, document, start, length (1 to W), check (64 bits), loss tokens; never read; version 1's
        ("buffer", {"buffer": {key: [entry, *rest]}})
        for entry in [[-1, *item[1:]], [99, *item[1:]], [True, *item[1:]], [item[0], "0", *item[2:]],
                      [*item[:2], -1, *item[3:]], [*item[:3], 0, *item[4:]], [*item[:3], 9, *item[4:]],
                      [*item[:4], 2**64], [*item[:4], 1.0], [*item[:5], -2], item[:4], [*item[:5], 1, 1],
                      {"example": 0}, [item[0], 0, 0, 4, {"input_ids": "AQAAAAIAAAA="}, {"input_ids": "<i4"}]]
    ] + [
        ("buffer", {"buffer": {key: item}}), ("buffer", {"buffer": {key: []}}),  # a group of pieces
        ("pending", {"pending": {}}), ("pending", {"pending": [[0, 0]]}),
        ("stats", {"stats": {**good["stats"], "windows": -1}}), ("stats", {"stats": {"windows": 1}}),
        ("stats", {"stats": None}), ("stats", {"stats": {**good["stats"], "tokens": 1.0}}),
        ("surprise", {"surprise": 1}),  # a field of no version
    ]
    out = [(name, {**good, **change}) for name, change in cases]
    out += [(name, {k: v for k, v in good.items() if k != name}) for name in good]  # every field missing
    crc = lambda e: [*e[:4], e[4] % 2**32, *e[5:]]  # version 2: CRC-32s, and no field for them
    v2 = {**{k: v for k, v in good.items() if k != "check"}, "version": 2, "checks": [],
          "buffer": {k: [crc(e) for e in g] for k, g in good["buffer"].items()},
          "pending": [crc(e) for e in good["pending"]]}
    out += [("check", {**v2, "check": "crc32"}),
            ("buffer", {**v2, "buffer": {**v2["buffer"], key: [[*item[:4], 2**32], *v2["buffer"][key][1:]]}})]
    return out


@pytest.mark.parametrize("name, bad", damaged(), ids=lambda x: x if isinstance(x, str) else "")
def test_a_damaged_state_is_refused_by_name_and_the_stream_is_unchanged(name, bad):
    stream, before = mid_stream()
    twin, _ = mid_stream()
    with pytest.raises((StateError, TypeError, ValueError)) as exc:
        stream.load_state_dict(bad)
    msg = str(exc.value)
    print(msg)
    assert "\n" not in msg and f"'{name}'" in msg, msg
    assert stream.state_dict() == before
    assert row_mismatch(list(stream), list(twin)) is None  # the stream goes on as if nothing had been loaded


def test_a_state_of_another_source_is_refused_at_the_example_it_was_saved_after():
    _, state = mid_stream()
    other = copy.deepcopy(SRC)
    j = state["checks"][-1][0]
    other[j]["input_ids"] = other[j]["input_ids"][::-1].copy()
    stream = pack_stream(other, **OPTS)
    stream.load_state_dict(state)
    with pytest.raises(DataError, match=f"example {j} of the source is not the example {j} the stream state"):
        list(stream)


def test_pieces_a_state_holds_are_checked_when_read_again():
    """A state holds where its pieces are in the source and their CRC (not their tokens, version 1's base64
    of them at 11 us a piece was most of what a state cost): each is read again before the first row and
    refused by name when the source there differs, or when the piece is not in its example."""
    _, state = mid_stream()
    key, (item, *rest) = next(iter(state["buffer"].items()))
    j = item[0]
    other = copy.deepcopy(SRC)
    other[j]["labels"] = [-100] * len(other[j]["labels"])  # the labels differ, the tokens do not
    outside = [[*item[:2], 2, *item[3:]], [item[0], 1, *item[2:]], [*item[:4], item[4] ^ 1]]
    for src, entry in [(other, item)] + [(SRC, e) for e in outside]:
        stream = pack_stream(src, **OPTS)
        stream.load_state_dict({**state, "buffer": {**state["buffer"], key: [entry, *rest]}})
        with pytest.raises(DataError, match=f"example {j} of the source is not the example {j} the stream state "
                           "holds a piece of") as exc:
            next(stream)
        assert "\n" not in str(exc.value)
    stream = pack_stream(SRC[:j], **OPTS)
    stream.load_state_dict({**state, "checks": []})  # the example it was saved after not checked: this one is
    with pytest.raises(DataError, match=f"the source ended before example {j}, which the stream state holds a piece"):
        next(stream)
    stream = pack_stream(SRC, **OPTS)
    stream.load_state_dict(state)
    again = stream.state_dict()  # a state taken before a row: the entries as loaded (their keys numbered anew)
    assert sum(again.pop("buffer").values(), []) == sum(state["buffer"].values(), [])
    assert again == {k: v for k, v in state.items() if k != "buffer"}


def test_one_token_or_label_changed_in_a_buffered_piece_is_refused_by_its_xxh64_check():
    """State version 3 checks each piece by XXH64 (0.45 us a 1,400-token piece; zlib's CRC-32 of version 2 took 1.3
    us, most of what a state every 100 rows cost): one token, or one label only, changed anywhere in a buffered
    piece between the save and the resume is refused before the first row, naming the example."""
    _, state = mid_stream()
    assert state["version"] == 3 and state["check"] == "xxh64", state
    for key, group in state["buffer"].items():
        for j, d, start, n, *_ in group:
            for column, at in [("input_ids", start), ("input_ids", start + n - 1), ("labels", start + n // 2)]:
                other = copy.deepcopy(SRC)
                values = other[j][column]
                values[at] = values[at] + 1 if isinstance(values, list) else values[at] ^ 1
                stream = pack_stream(other, **OPTS)
                stream.load_state_dict({**state, "checks": []})  # the pieces' checks alone
                with pytest.raises(DataError, match=f"example {j} of the source is not the example {j} the stream "
                                   f"state holds a piece of \\(its tokens {start} to {start + n} of document {d}"):
                    next(stream)


def test_a_crc32_state_resumes_and_one_needing_xxhash_is_refused_where_it_is_missing(monkeypatch):
    """Without xxhash a stream checks by CRC-32 and says so (``check``); a version-2 state (CRC-32, before the field)
    still resumes exactly; a state checked by XXH64 is refused by name, with the fix, where xxhash is missing."""
    from packkit import packer

    xxh64_state = mid_stream()[1]
    real = packer._check_function
    monkeypatch.setattr(packer, "_check_function", lambda name: None if name == "xxh64" else real(name))
    stream, state = mid_stream()
    assert state["check"] == "crc32" and max(e[4] for g in state["buffer"].values() for e in g) < 2**32
    rest = list(stream)
    for saved in (state, {**{k: v for k, v in state.items() if k != "check"}, "version": 2}):
        again = pack_stream(SRC, **OPTS)
        again.load_state_dict(roundtrip(saved))
        assert row_mismatch(list(again), rest) is None
    with pytest.raises(StateError, match="field 'check': 'xxh64' needs the xxhash package, not installed here: "
                       "pip install xxhash"):
        pack_stream(SRC, **OPTS).load_state_dict(xxh64_state)


def test_a_state_whose_columns_hold_no_input_ids_blames_the_state():
    """A damaged state whose ``read`` lacks ``input_ids`` (a stream given no columns reads it first): the one line
    names the state's field, not the source (it said "no 'input_ids' column; the columns are ['x']: pass
    columns=NAME,...", the data blamed for what the state said, since the pieces left the state)."""
    _, state = mid_stream()
    stream = pack_stream(SRC, **OPTS)  # a fresh stream, as a resume builds: its columns are the state's
    before = stream.state_dict()
    with pytest.raises(StateError, match="stream state field 'read': .* lacks 'input_ids'") as exc:
        stream.load_state_dict({**state, "read": ["x"]})
    assert "\n" not in str(exc.value) and stream.state_dict() == before
    source = [{k: v for k, v in ex.items() if k != "labels"} for ex in SRC]  # the state read labels; these have none
    stream = pack_stream(source, **OPTS)
    stream.load_state_dict(state)
    with pytest.raises(DataError) as exc:
        next(stream)
    print(exc.value)
    assert "\n" not in str(exc.value)


def test_a_state_past_the_end_of_a_shorter_source_is_refused():
    _, state = mid_stream()
    j = state["checks"][-1][0]
    stream = pack_stream(SRC[:j], **OPTS)
    stream.load_state_dict(state)
    with pytest.raises(DataError, match=f"the source ended before example {j}, which the stream state was saved"):
        list(stream)


def test_shards_of_another_run_or_a_missing_shard_are_refused():
    src = make_examples([3, 5, 2, 7, 1, 4, 6, 2], seed=6)
    rng = np.random.default_rng(0)
    _, states = run_shards(src, OPTS, 2, None, rng, stop=True)
    target = pack_stream(src, shard=0, num_shards=3, **OPTS)
    with pytest.raises(StateError, match="field 'shard'.*pass the state of every shard once"):
        target.load_state_dict(states[:1])
    with pytest.raises(StateError, match="field 'shard'.*pass the list of every shard's state"):
        target.load_state_dict(states[1])
    moved = [states[0], {**states[1], "start": 1}]
    with pytest.raises(StateError, match="field 'start'"):
        target.load_state_dict(moved)


def test_a_one_shot_iterator_already_read_cannot_load():
    stream = pack_stream(iter(SRC), **OPTS)
    next(stream)
    state = stream.state_dict()
    with pytest.raises(ValueError, match="one-shot iterator: build a new pack_stream over a fresh iterator"):
        stream.load_state_dict(state)
    fresh = pack_stream(iter(SRC), **OPTS)  # a fresh iterator from the start: fine
    fresh.load_state_dict(state)
    assert pieces([*(list(pack_stream(SRC, **OPTS))[:1]), *fresh]) == pieces(list(pack_stream(SRC, **OPTS)))


# -- the real consumers: DataLoader, StatefulDataLoader, ranks, a killed process -----------------------------

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

from packkit.streaming import PackedIterable, shard_states  # noqa: E402

LOADER_SRC = make_examples(np.random.default_rng(7).integers(1, 70, 240), seed=7)
LOADER_OPTS = dict(window=64, buffer_size=16, overflow="split", example_ids=True)


def full_rows():
    return list(pack_stream(LOADER_SRC, **LOADER_OPTS))


def test_dataloader_without_workers_resumes_at_random_batches():
    full = full_rows()
    rng = np.random.default_rng(8)
    for k in rng.integers(0, len(full), 6).tolist() + [0, len(full)]:
        ds = PackedIterable(LOADER_SRC, **LOADER_OPTS)
        it = iter(DataLoader(ds, batch_size=None, num_workers=0))
        first = [next(it) for _ in range(k)]
        state = roundtrip(ds.state_dict())
        again = PackedIterable(LOADER_SRC, **LOADER_OPTS)
        again.load_state_dict(state)
        rest = list(DataLoader(again, batch_size=None, num_workers=0))
        assert row_mismatch([{c: np.asarray(v) for c, v in r.items()} for r in first + rest], full) is None


@pytest.mark.slow
def test_dataloader_with_workers_refuses_to_save_behind_them():
    """Two workers pack and prefetch: the loop's process cannot know which rows were used; a state taken
    there would repeat or skip examples, so it is refused in one line naming StatefulDataLoader."""
    ds = PackedIterable(LOADER_SRC, **LOADER_OPTS)
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    it = iter(loader)
    next(it)
    with pytest.raises(ValueError, match="StatefulDataLoader.*or pass num_workers=0") as exc:
        ds.state_dict()
    assert "\n" not in str(exc.value)
    del it
    rows = list(DataLoader(ds, batch_size=None, num_workers=2))  # two workers, two shards: every piece once
    assert pieces([{c: np.asarray(v) for c, v in r.items()} for r in rows]) == pieces(full_rows())


@pytest.mark.slow
def test_stateful_dataloader_with_two_workers_resumes_exactly():
    StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
    full = list(StatefulDataLoader(PackedIterable(LOADER_SRC, **LOADER_OPTS), batch_size=None, num_workers=2))
    rng = np.random.default_rng(9)
    for k in [0, 1, int(rng.integers(2, len(full)))]:
        loader = StatefulDataLoader(PackedIterable(LOADER_SRC, **LOADER_OPTS), batch_size=None, num_workers=2)
        it = iter(loader)
        first = [next(it) for _ in range(k)]
        state = loader.state_dict()
        del it
        again = StatefulDataLoader(PackedIterable(LOADER_SRC, **LOADER_OPTS), batch_size=None, num_workers=2)
        again.load_state_dict(state)
        rest = list(again)
        print(k, len(first), len(rest), len(full))
        # the same workers: the rows of an uninterrupted run, in its order
        assert row_mismatch([{c: np.asarray(v) for c, v in r.items()} for r in first + rest],
                            [{c: np.asarray(v) for c, v in r.items()} for r in full]) is None


@pytest.mark.slow
def test_world_size_change_through_stateful_loaders():
    """2 ranks x 2 workers, stopped at different batches; resumed on 3 ranks without workers, then the
    rest: every piece once."""
    StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
    rows, states = [], []
    for rank, k in ((0, 5), (1, 9)):
        loader = StatefulDataLoader(PackedIterable(LOADER_SRC, rank=rank, world_size=2, **LOADER_OPTS),
                                    batch_size=None, num_workers=2)
        it = iter(loader)
        rows += [next(it) for _ in range(k)]
        states.append(loader.state_dict())
        del it
    shards = shard_states(states)
    assert len(shards) == 4
    for rank in range(3):
        ds = PackedIterable(LOADER_SRC, rank=rank, world_size=3, **LOADER_OPTS)
        ds.load_state_dict(roundtrip(shards))
        rows += list(DataLoader(ds, batch_size=None, num_workers=0))
    assert pieces([{c: np.asarray(v) for c, v in r.items()} for r in rows]) == pieces(full_rows())


@pytest.mark.slow
def test_a_datasets_iterable_source_is_read_whole_in_each_worker():
    """A datasets.IterableDataset of 3 shards iterated inside a worker yields that worker's files only;
    PackedIterable reads it whole (its public .iter) and shards by example, so 2 workers pack every piece once."""
    datasets = pytest.importorskip("datasets")
    src = [{"input_ids": ex["input_ids"].tolist()} for ex in LOADER_SRC[:120]]
    parts = [src[0:40], src[40:80], src[80:120]]
    ids = datasets.IterableDataset.from_generator(lambda parts: (ex for p in parts for ex in p),
                                                  gen_kwargs={"parts": parts})
    assert ids.num_shards == 3
    opts = dict(LOADER_OPTS)
    rows = list(DataLoader(PackedIterable(ids, **opts), batch_size=None, num_workers=2))
    want = list(pack_stream([{"input_ids": np.asarray(e["input_ids"])} for e in src], **opts))
    assert pieces([{c: np.asarray(v) for c, v in r.items()} for r in rows]) == pieces(want)


CHILD = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    from torchdata.stateful_dataloader import StatefulDataLoader
    from packkit.streaming import PackedIterable

    folder = sys.argv[1]
    src = [json.loads(line) for line in open(os.path.join(folder, "src.jsonl"))]
    ds = PackedIterable(src, window=64, buffer_size=16, overflow="split", example_ids=True)
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    ckpt = os.path.join(folder, "ckpt.json")
    done = 0
    if os.path.exists(ckpt):
        saved = json.load(open(ckpt))
        loader.load_state_dict(saved["loader"])
        done = saved["rows"]
    log = open(os.path.join(folder, "rows.jsonl"), "r+" if done else "w")
    for _ in range(done):      # the rows trained after the checkpoint are trained again: drop them
        log.readline()
    log.seek(log.tell())       # drop the read-ahead: a text file's writes after reads went past EOF (NUL bytes)
    log.truncate()
    for row in loader:
        log.write(json.dumps({k: np.asarray(v).tolist() for k, v in row.items()}) + "\\n")
        log.flush()
        done += 1
        if done % 3 == 0:      # a checkpoint: written beside, renamed when complete
            with open(ckpt + ".tmp", "w") as f:
                json.dump({"rows": done, "loader": loader.state_dict()}, f)
            os.replace(ckpt + ".tmp", ckpt)
        if os.environ.get("SLOW"):
            import time; time.sleep(0.01)
    print("finished", done)
""")


@pytest.mark.slow
def test_a_killed_process_resumes_from_its_last_checkpoint(tmp_path):
    """A real training-loop process (StatefulDataLoader, 2 workers) killed with SIGKILL after its checkpoint
    at a random row, then run again: it resumes from the checkpoint; the rows logged equal one run's."""
    pytest.importorskip("torchdata")
    src = [{"input_ids": ex["input_ids"].tolist()} for ex in LOADER_SRC[:150]]
    (tmp_path / "src.jsonl").write_text("".join(json.dumps(e) + "\n" for e in src))
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "SLOW": "1", "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    ckpt = tmp_path / "ckpt.json"
    stop_after = int(np.random.default_rng().integers(2, 8))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if ckpt.exists() and json.loads(ckpt.read_text())["rows"] >= 3 * stop_after:
            break
        assert child.poll() is None, child.communicate()
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait()
    killed_at = json.loads(ckpt.read_text())["rows"]
    logged = len((tmp_path / "rows.jsonl").read_text().splitlines())
    print("killed after", logged, "rows logged, checkpoint at", killed_at)
    env.pop("SLOW")
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    want = DataLoader(PackedIterable(src, window=64, buffer_size=16, overflow="split", example_ids=True),
                      batch_size=None, num_workers=2)  # the same two shards, uninterrupted
    assert rows == [{k: np.asarray(v).tolist() for k, v in r.items()} for r in want]


# -- pack_dataset's IterableDataset -------------------------------------------------------------------------


def sharded_source(n=300, seed=10):
    """A datasets.IterableDataset of ``n`` examples in 3 shards (files, as a hub dataset has)."""
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(seed)
    src = [{"input_ids": rng.integers(0, 100, k).tolist()} for k in rng.integers(1, 70, n)]
    parts = [src[i::3] for i in range(3)]
    ids = datasets.IterableDataset.from_generator(lambda parts: (e for p in parts for e in p),
                                                  gen_kwargs={"parts": parts})
    assert ids.num_shards == 3
    return ids


@pytest.mark.parametrize("shuffle", [False, True])
def test_pack_dataset_iterable_resumes_exactly_through_its_state(shuffle):
    """Before, with shuffle=True (the default), datasets' shuffle dropped its buffer on load_state_dict:
    11 to 14 of 364 rows were never trained, with a log line only. Now the rows are a function of the
    source and the options, and datasets' state (rows yielded) resumes them exactly."""
    from packkit.offline import pack_dataset

    ids = sharded_source()
    make = lambda: pack_dataset(ids, window=64, buffer_size=16, shuffle=shuffle, seed=3, example_ids=True)  # noqa: E731
    full = list(make())
    for k in (0, 7, len(full) // 2, len(full)):
        out = make()
        it = iter(out)
        first = [next(it) for _ in range(k)]
        state = roundtrip(out.state_dict())
        again = make()
        again.load_state_dict(state)
        assert first + list(again) == full, k


@pytest.mark.slow
def test_pack_dataset_iterable_in_two_workers_packs_every_example():
    """Before, the one worker that packs (the output has one shard) iterated the source inside a worker,
    where datasets yields that worker's files only: 200 of 600 examples were silently never packed."""
    from packkit.offline import pack_dataset

    ids = sharded_source(600)
    out = pack_dataset(ids, window=64, buffer_size=16, shuffle=False, example_ids=True)
    rows = list(DataLoader(out, batch_size=None, num_workers=2))
    assert sorted({int(e) for r in rows for e in r["example_ids"]}) == list(range(600))


@pytest.mark.slow
def test_the_streaming_snippet_runs_as_pasted():
    """The offline page's streaming block, taken from the page itself, on real chat lengths (2 workers)."""
    pytest.importorskip("torchdata")
    from test_readme import doc_code

    code = doc_code("docs/offline.md", "## Streams", "python")
    lengths = np.load(LENGTHS)[:400]
    namespace = {"examples": make_examples(lengths, seed=11), "rank": 0, "world_size": 1}
    exec(compile(code, "docs/offline.md", "exec"), namespace)
    full = list(DataLoader(PackedIterable(namespace["examples"], window=2048), batch_size=None, num_workers=2))
    saved_at = namespace["step"] // 100 * 100  # the last checkpoint: after row saved_at
    rest = list(namespace["loader"])
    print(len(full), "rows, checkpoint after row", saved_at)
    assert len(full) > 100 and len(rest) == len(full) - saved_at - 1
    assert row_mismatch([{c: np.asarray(v) for c, v in r.items()} for r in rest],
                        [{c: np.asarray(v) for c, v in r.items()} for r in full[saved_at + 1:]]) is None


def _gloo_rank(rank: int, world_size: int, port: int, folder: str, stop: int):
    """One data-parallel rank: packs its shard, stops after ``stop + rank`` rows, and rank 0 gathers every
    rank's state (all_gather_object, as a checkpoint would) into a file."""
    import pickle

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with gloo_group(rank, world_size, port=None, timeout_s=60):
        folder = Path(folder)
        ds = PackedIterable(LOADER_SRC, rank=rank, world_size=world_size, **LOADER_OPTS)
        rows = []
        for row in DataLoader(ds, batch_size=None, num_workers=0):
            rows.append({c: np.asarray(v) for c, v in row.items()})
            if len(rows) > stop + rank:
                break
        (folder / f"rows-{rank}.pkl").write_bytes(pickle.dumps(rows))
        states = [None] * world_size
        dist.all_gather_object(states, ds.state_dict())
        if rank == 0:
            (folder / "states.json").write_text(json.dumps(states))


@pytest.mark.slow
def test_a_world_size_change_after_gloo_ranks(tmp_path):
    """2 gloo ranks stopped at different rows, their states gathered on rank 0 and saved; 3 ranks resume from
    that file: every piece of every example once."""
    import pickle

    from testlib import free_port, run_processes

    run_processes(_gloo_rank, 2, (2, free_port(), str(tmp_path), 7), timeout_s=120)
    rows = [r for f in sorted(tmp_path.glob("rows-*.pkl")) for r in pickle.loads(f.read_bytes())]
    states = json.loads((tmp_path / "states.json").read_text())
    for rank in range(3):
        ds = PackedIterable(LOADER_SRC, rank=rank, world_size=3, **LOADER_OPTS)
        ds.load_state_dict(states)
        rows += [{c: np.asarray(v) for c, v in r.items()} for r in DataLoader(ds, batch_size=None)]
    assert pieces(rows) == pieces(full_rows())
