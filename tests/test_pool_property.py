"""Property test of the paged pool against a plain-Python shadow model (issue 21).

A hypothesis state machine drives >= 10,000 random operations through the pool
functions, jit-compiled once for one small pool shape: reserve, write (into shared
pages and past the reserved pages too), reserve-then-write, fork, release, evict
pages, and adversarial steps (NaN/Inf/huge keys and values and valid-looking
positions planted in every page nobody reads, negative and overflowing counts,
out-of-range fork sources, eager and under jit). After every operation:

- `check_pool(pool, layers)` passes: every invariant holds, no flag is set (a step
  that should set one is checked to set exactly the expected record, then cleared);
- the pool's structure equals the shadow's (same pages per row, up to renaming;
  same lengths, same free-page count);
- what attention reads (the pages the kernel is handed, and the gathered dense view)
  equals the shadow slot for slot, and every value a sequence can read is one it
  wrote or inherited by fork.

The same machine runs over a tiered pool (spill, restore, prefetch; out-of-range page ids
refused eagerly and recorded under jit), and a third drives a paged KIVI layer
(`kvjax.memory.paged_kivi`) against the unpaged KIVI cache given the same writes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, rule,
                                 run_state_machine_as_test)

from kvjax import EMPTY
from kvjax.backends.pallas import kernel_inputs
from kvjax.memory.paging import (NULL_PAGE, check_pool, dense_view, evict_pages, fork,
                                 init_paged_cache, release, reserve)

B, KVH, S, NP, P, D, LAYERS = 3, 2, 4, 4, 19, 4, 2
PD = 12  # the tiered machine: page ids below PD on the device, the other 7 in host memory
CAP = NP * S
MIN_OPERATIONS = 10_000  # the pool machine's, in the thorough profile


def thorough() -> bool:
    """`pytest --hypothesis-profile thorough`: the machines at full length (>= 10,000 pool
    operations); the default profile runs a third of the examples and asserts a quarter of the
    operations (the count varies from run to run: 237 and 261 for the tiered machine at 7
    examples)."""
    return settings.get_current_profile_name() == "thorough"


def fewest_operations(full: int) -> int:
    """The operations a machine must reach: `full` in the thorough profile, a quarter otherwise."""
    return full if thorough() else full // 4


def machine_settings(examples: int, steps: int) -> settings:
    """`examples` in the thorough profile, a third of them (rounded up) otherwise; derandomized
    (the same operations on every run: CI is reproducible), no deadline."""
    return settings(max_examples=examples if thorough() else -(-examples // 3),
                    stateful_step_count=steps, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck))


ZERO4 = jnp.zeros((4,), jnp.int32)

reserve_jit, fork_jit = jax.jit(reserve), jax.jit(fork)
release_jit, evict_jit = jax.jit(release), jax.jit(evict_pages)


@jax.jit
def write_all(layers, k, v, pos):
    return tuple(layer.write(k, v, pos) for layer in layers)


@jax.jit
def plant(layers, pages, value, pos):
    """Garbage into pages [P] bool of every layer: keys/values `value`, positions `pos` [S]."""
    def one(layer):
        m = pages[:, None, None]
        return layer.replace(k=jnp.where(m, value, layer.k), v=jnp.where(m, -value, layer.v),
                             pos=jnp.where(m, pos[None, None, :], layer.pos))
    return tuple(one(layer) for layer in layers)


def unread_pages(layer) -> np.ndarray:
    """[P] bool: the pages no row's table lists (free and reserved ones), never the null page."""
    used = np.arange(layer.tables.shape[-1]) < np.asarray(layer.num_pages_used)[..., None]
    read = np.zeros(layer.pos.shape[0], bool)
    read[np.asarray(layer.tables)[used]] = True
    read[NULL_PAGE] = True
    return ~read


class Counter:
    operations = 0


class Shadow:
    """The pool as plain Python: pages by shadow id with reference counts and slot contents
    (None = EMPTY, else the key value written), rows as page lists and lengths, and the
    values each row may read (written by it or inherited by fork)."""

    def __init__(self):
        self.refc, self.content, self.next_id = {}, {}, 1
        self.pages = [[[] for _ in range(KVH)] for _ in range(B)]
        self.length = [[0] * KVH for _ in range(B)]
        self.allowed = [[set() for _ in range(KVH)] for _ in range(B)]

    def new_page(self, content=None):
        pid, self.next_id = self.next_id, self.next_id + 1
        self.refc[pid] = 1
        self.content[pid] = list(content) if content is not None else [("?",)] * S  # unread
        return pid

    def unref(self, pid):
        self.refc[pid] -= 1
        if self.refc[pid] == 0:
            del self.refc[pid], self.content[pid]

    @property
    def free(self):
        return P - 1 - len(self.refc)

    def room(self):
        """Free pages `reserve` may allocate."""
        return self.free

    def have(self, b, h):
        return -(-self.length[b][h] // S)

    def reserve(self, n):
        """-> fits; applies the allocation when it fits (all or nothing)."""
        plan, fresh = {}, 0
        for b in range(B):
            for h in range(KVH):
                ln, held, have = self.length[b][h], len(self.pages[b][h]), self.have(b, h)
                need = -(-(ln + n[b]) // S)
                if need > NP:
                    return False
                cow = ln % S != 0 and n[b] > 0 and self.refc[self.pages[b][h][have - 1]] > 1
                grow = max(need - held, 0)
                plan[b, h] = (cow, grow)
                fresh += grow + cow
        if fresh > self.room():
            return False
        for (b, h), (cow, grow) in plan.items():
            pages = self.pages[b][h]
            if cow:
                old = pages[self.have(b, h) - 1]
                pages[self.have(b, h) - 1] = self.new_page(self.content[old])
                self.unref(old)
            pages.extend(self.new_page() for _ in range(grow))
        return True

    def write(self, values, real, positions):
        """values [B, KVH, T] key values; real [B, T]; -> expected layer error record."""
        t = values.shape[-1]
        shared_err = unheld_err = None
        for b in range(B):
            for h in range(KVH):
                ln, pages = self.length[b][h], self.pages[b][h]
                shared = lambda idx: self.refc[pages[idx]] > 1
                for idx in range(self.have(b, h), len(pages)):  # pages this write starts
                    if idx * S < ln + t and not shared(idx):
                        self.content[pages[idx]] = [None] * S
                for i in range(t):
                    slot = ln + i
                    if slot >= len(pages) * S:
                        if real[b, i] and unheld_err is None:
                            unheld_err = (6, b, h, slot)
                    elif shared(slot // S):
                        if real[b, i] and shared_err is None:
                            shared_err = (5, b, h, slot)
                    elif real[b, i]:
                        self.content[pages[slot // S]][slot % S] = (float(values[b, h, i]),
                                                                    int(positions[b, i]))
                        self.allowed[b][h].add(float(values[b, h, i]))
                self.length[b][h] = min(ln + t, len(pages) * S)
        return shared_err or unheld_err or (0, 0, 0, 0)

    def fork(self, source):
        """-> expected pool error record (all or nothing)."""
        for b, s in enumerate(source):
            if not -1 <= s < B:
                return (3, b, s, B)
        for b, s in enumerate(source):
            if s >= 0:
                written = max(self.length[b])
                held = max(len(p) for p in self.pages[b])
                if written or held:
                    return (4, b, written, held)
        old = ([[list(p) for p in row] for row in self.pages], [list(r) for r in self.length],
               [[set(a) for a in row] for row in self.allowed])
        for b, s in enumerate(source):
            if s < 0:
                continue
            for h in range(KVH):
                ln = old[1][s][h]
                inherited = old[0][s][h][:-(-ln // S)]
                for pid in inherited:
                    self.refc[pid] += 1
                self.pages[b][h], self.length[b][h] = list(inherited), ln
                self.allowed[b][h] = set(old[2][s][h])
        return (0, 0, 0, 0)

    def release(self, rows):
        for b in np.nonzero(rows)[0]:
            for h in range(KVH):
                for pid in self.pages[b][h]:
                    self.unref(pid)
                self.pages[b][h], self.length[b][h] = [], 0
                self.allowed[b][h] = set()

    def evict(self, drop):
        for b in range(B):
            for h in range(KVH):
                gone = [i for i in range(self.have(b, h) - 1) if drop[b, h, i]]
                for i in gone:
                    self.unref(self.pages[b][h][i])
                self.pages[b][h] = [p for i, p in enumerate(self.pages[b][h]) if i not in gone]
                self.length[b][h] -= S * len(gone)


class PoolMachine(RuleBasedStateMachine):
    snapshot = staticmethod(lambda pool, layers: snapshot(pool, layers))

    @initialize()
    def start(self):
        self.pool, self.layers = init_paged_cache(P, S, B, KVH, NP, D, num_layers=LAYERS)
        self.shadow = Shadow()
        self.next_token = 1
        self.next_pos = [0] * B

    # ---- helpers
    def clear_flags(self):
        self.pool = self.pool.replace(error=ZERO4, overflow=jnp.zeros((), bool))

    def expect_pool_error(self, record):
        np.testing.assert_array_equal(np.asarray(self.pool.error), record)
        self.clear_flags()

    def do_reserve(self, n, jit):
        fits = self.shadow.reserve(n)
        self.pool, self.layers = (reserve_jit if jit else reserve)(
            self.pool, self.layers, jnp.asarray(n, jnp.int32))
        assert bool(self.pool.overflow) == (not fits)
        np.testing.assert_array_equal(np.asarray(self.pool.error), ZERO4)
        self.clear_flags()
        return fits

    def do_write(self, t, padding):
        tokens = self.next_token + np.arange(B * t).reshape(B, t)
        self.next_token += B * t
        real = ~np.asarray(padding, bool).reshape(B, t)
        positions = np.full((B, t), EMPTY, np.int32)
        for b in range(B):
            for i in range(t):
                if real[b, i]:
                    positions[b, i] = self.next_pos[b]
                    self.next_pos[b] += 1
        values = (tokens[:, None, :] * KVH + np.arange(KVH)[None, :, None]).astype(np.float32)
        expected = self.shadow.write(values, real, positions)
        k = jnp.broadcast_to(jnp.asarray(values)[..., None], (B, KVH, t, D))
        self.layers = write_all(self.layers, k, -k, jnp.asarray(positions))
        for layer in self.layers:
            np.testing.assert_array_equal(np.asarray(layer.error), expected)
        self.layers = tuple(layer.replace(error=ZERO4) for layer in self.layers)

    # ---- operations
    @rule(n=st.lists(st.integers(0, 6), min_size=B, max_size=B), jit=st.booleans())
    def reserve_room(self, n, jit):
        Counter.operations += 1
        self.do_reserve(n, jit)

    @rule(t=st.sampled_from([1, 2, 3, 5]), padding=st.lists(st.booleans(), min_size=15,
                                                              max_size=15))
    def write_without_reserve(self, t, padding):
        Counter.operations += 1
        self.do_write(t, [p and i % 3 == 0 for i, p in enumerate(padding[:B * t])])

    @rule(t=st.sampled_from([1, 2, 3, 5]), padding=st.lists(st.booleans(), min_size=15,
                                                              max_size=15))
    def reserve_then_write(self, t, padding):
        Counter.operations += 2
        if self.do_reserve([t] * B, jit=True):
            self.do_write(t, [p and i % 4 == 0 for i, p in enumerate(padding[:B * t])])

    @rule(dst=st.integers(0, B - 1), source=st.integers(0, B - 1), first=st.booleans(),
          jit=st.booleans())
    def fork_sequence(self, dst, source, first, jit):
        Counter.operations += 1
        written = [b for b in range(B) if max(self.shadow.length[b]) > 0 and b != dst]
        if written:  # prefer sharing something
            source = written[source % len(written)]
        if first:  # the usual way: release the dst, then fork into it
            self.release_rows(np.arange(B) == dst)
        src = np.full(B, -1)
        src[dst] = source
        expected = self.shadow.fork(src.tolist())
        self.pool, self.layers = (fork_jit if jit else fork)(self.pool, self.layers,
                                                             jnp.asarray(src, jnp.int32))
        assert bool(self.pool.overflow) == (expected[0] == 4)
        self.expect_pool_error(expected)
        if expected[0] == 0:
            self.next_pos[dst] = self.next_pos[source]

    @rule(dst=st.integers(0, B - 1), source=st.integers(0, B - 1), t=st.sampled_from([1, 2, 5]),
          padding=st.lists(st.booleans(), min_size=15, max_size=15))
    def fork_then_write_without_reserve(self, dst, source, t, padding):
        """Both sharers write at once, no reserve: a partly filled shared page is refused."""
        self.fork_sequence(dst, source, first=True, jit=True)
        Counter.operations += 1
        self.do_write(t, [p and i % 3 == 0 for i, p in enumerate(padding[:B * t])])

    def release_rows(self, rows):
        self.shadow.release(rows)
        self.pool, self.layers = release_jit(self.pool, self.layers, jnp.asarray(rows))
        for b in np.nonzero(rows)[0]:
            self.next_pos[b] = 0

    @rule(rows=st.lists(st.booleans(), min_size=B, max_size=B))
    def release_sequences(self, rows):
        Counter.operations += 1
        self.release_rows(np.asarray(rows, bool))

    @rule(bits=st.integers(0, 2 ** (B * KVH * NP) - 1))
    def evict(self, bits):
        Counter.operations += 1
        drop = np.array([(bits >> i) & 1 for i in range(B * KVH * NP)], bool).reshape(B, KVH, NP)
        self.shadow.evict(drop)
        self.pool, self.layers = evict_jit(self.pool, self.layers, jnp.asarray(drop))

    @rule(value=st.sampled_from([np.nan, np.inf, -np.inf, 1e30]), shift=st.integers(-3, 40))
    def plant_garbage(self, value, shift):
        """Adversary: garbage in every page no row reads (free pages and reserved ones)."""
        Counter.operations += 1
        pages = unread_pages(self.layers[0])
        self.layers = plant(self.layers, jnp.asarray(pages), jnp.float32(value),
                            jnp.arange(S, dtype=jnp.int32) + shift)

    @rule(b=st.integers(0, B - 1), bad=st.sampled_from([-1, -5, CAP + 1, 2 ** 31 - 1]),
          jit=st.booleans())
    def reserve_bad_count(self, b, bad, jit):
        Counter.operations += 1
        n = np.ones(B, np.int64)
        n[b] = bad
        code = 1 if bad < 0 else 2
        before = (np.asarray(self.pool.refcount), np.asarray(self.layers[0].tables))
        if jit:
            self.pool, self.layers = reserve_jit(self.pool, self.layers,
                                                 jnp.asarray(n.astype(np.int32)))
            assert not bool(self.pool.overflow)
            self.expect_pool_error((code, b, bad, CAP))
        else:
            with pytest.raises(ValueError, match=rf"new_tokens\[{b}\] = {bad}"):
                reserve(self.pool, self.layers, n)
        np.testing.assert_array_equal(np.asarray(self.pool.refcount), before[0])
        np.testing.assert_array_equal(np.asarray(self.layers[0].tables), before[1])

    @rule(b=st.integers(0, B - 1), bad=st.sampled_from([-2, -100, B, B + 7]), jit=st.booleans())
    def fork_bad_source(self, b, bad, jit):
        Counter.operations += 1
        src = np.full(B, -1, np.int32)
        src[b] = bad
        if jit:
            self.pool, self.layers = fork_jit(self.pool, self.layers, jnp.asarray(src))
            self.expect_pool_error((3, b, bad, B))
        else:
            with pytest.raises(ValueError, match=rf"source\[{b}\] = {bad}"):
                fork(self.pool, self.layers, jnp.asarray(src))

    # ---- after every operation
    @invariant()
    def pool_matches_the_shadow(self):
        if not hasattr(self, "pool"):
            return
        check_pool(self.pool, self.layers)  # every invariant, no flag
        sh = self.shadow
        refcount, layers = jax.device_get(self.snapshot(self.pool, self.layers))
        assert int((refcount[1:] == 0).sum()) == sh.free
        ids = {}  # device page -> shadow page: must be one-to-one
        for got in layers:
            for b in range(B):
                for h in range(KVH):
                    mine, ln, have = sh.pages[b][h], sh.length[b][h], sh.have(b, h)
                    row = got["tables"][b, h]
                    assert got["lengths"][b, h] == ln
                    assert list(row[len(mine):]) == [NULL_PAGE] * (NP - len(mine))
                    for dev, pid in zip(row[:len(mine)], mine):
                        assert ids.setdefault(int(dev), pid) == pid
                    # every slot the kernel may read: the pages it is handed, whole
                    assert got["num_pages"][b, h] == have
                    pages = row[:have]
                    k, v = got["k"][pages].reshape(-1, D), got["v"][pages].reshape(-1, D)
                    pos = got["pos"][pages].reshape(-1)
                    want = [slot for pid in mine[:have] for slot in sh.content[pid]]
                    assert ("?",) not in want, "a row reads a page nobody scrubbed"
                    empty = np.array([w is None for w in want], bool)
                    want_k = np.array([0.0 if w is None else w[0] for w in want], np.float32)
                    want_pos = np.array([EMPTY if w is None else w[1] for w in want], np.int32)
                    assert np.array_equal(pos, want_pos), (b, h, pos, want_pos)
                    assert np.array_equal(k, np.repeat(want_k[:, None], D, 1)), (b, h, k, want)
                    assert np.array_equal(v, -k), (b, h, v)  # EMPTY: zero, so 0 * x stays 0
                    assert set(want_k[~empty].tolist()) <= sh.allowed[b][h]  # written/inherited
                    # the dense view (XLA paths): the same slots up to the length, nothing after
                    vpos, vk = got["vpos"][b, h], got["vk"][b * KVH + h]
                    assert np.array_equal(vpos[:ln], pos[:ln]), (b, h, vpos, pos)
                    assert np.all(vpos[ln:] == EMPTY)
                    assert np.isfinite(vk).all() and np.isfinite(got["vv"][b * KVH + h]).all()
                    assert set(vk[vpos != EMPTY, 0].tolist()) <= sh.allowed[b][h]
        assert len(set(ids.values())) == len(ids)


@jax.jit
def snapshot(pool, layers):
    """Everything the invariant reads, in one transfer: per layer its tables, lengths,
    pages, what the kernel is handed (`kernel_inputs`) and the dense view."""
    out = []
    for layer in layers:
        view, inputs = dense_view(layer), kernel_inputs(layer)
        out.append(dict(tables=layer.tables, lengths=layer.lengths, k=layer.k, v=layer.v,
                        pos=layer.pos[:, 0], num_pages=inputs["num_pages"], vk=view.k,
                        vv=view.v, vpos=view.pos))
    return pool.refcount, out


def test_pool_against_shadow_model():
    Counter.operations = 0
    run_state_machine_as_test(PoolMachine, settings=machine_settings(260, 50))
    print(f"{Counter.operations} pool operations against the shadow model")
    assert Counter.operations >= fewest_operations(MIN_OPERATIONS), Counter.operations


# ---------------------------------------------------------------------------------------------
# Across memory tiers (issue 20): the same machine over a tiered pool, with spill, restore and
# prefetch steps; what each row reads goes through the stage (`tiered_view`).

from kvjax.memory import tiers  # noqa: E402


class TieredShadow(Shadow):
    """The shadow plus which pages are in host memory (learned from the pool after a spill or
    restore: the policy picks the pages; what rows read must not change)."""

    def __init__(self):
        super().__init__()
        self.host = set()

    def unref(self, pid):
        super().unref(pid)
        if pid not in self.refc:
            self.host.discard(pid)

    def room(self):
        return PD - 1 - (len(self.refc) - len(self.host))


spill_jit = jax.jit(tiers.spill)
restore_jit = jax.jit(tiers.restore)


@jax.jit
def plant_tiered(layers, pages, value, pos):
    """`plant` for tiered layers: garbage into both tiers' unread pages."""
    def one(layer):
        dev, host = pages[:PD, None, None], pages[PD:, None, None]
        back = lambda x, c: tiers._to_host(jnp.where(host, c, tiers._to_device(x)))
        return layer.replace(k=jnp.where(dev, value, layer.k), v=jnp.where(dev, -value, layer.v),
                             host_k=back(layer.host_k, value), host_v=back(layer.host_v, -value),
                             pos=jnp.where(pages[:, None, None], pos[None, None, :], layer.pos))
    return tuple(one(layer) for layer in layers)


@jax.jit
def snapshot_tiered(pool, layers):
    """`snapshot` read through the tiers: pages from both, the view through the stage."""
    out = []
    for layer in layers:
        view = tiers.tiered_view(layer)
        k, v = layer.all_pages()
        out.append(dict(tables=layer.tables, lengths=layer.lengths, k=k, v=v,
                        pos=layer.pos[:, 0], num_pages=layer.num_pages_used, vk=view.k,
                        vv=view.v, vpos=view.pos))
    return pool.refcount, out


class TieredPoolMachine(PoolMachine):
    snapshot = staticmethod(lambda pool, layers: snapshot_tiered(pool, layers))

    @initialize()
    def start(self):
        self.pool, self.layers = tiers.init_tiered_cache(PD, P - PD, S, B, KVH, NP, D,
                                                         num_layers=LAYERS)
        self.shadow = TieredShadow()
        self.next_token = 1
        self.next_pos = [0] * B

    def learn_tiers(self):
        """Which shadow pages are on the host now (the table ids of their rows)."""
        tables = np.asarray(self.layers[0].tables)
        self.shadow.host = {pid for b in range(B) for h in range(KVH)
                            for dev, pid in zip(tables[b, h], self.shadow.pages[b][h])
                            if dev >= PD}

    @rule(n=st.integers(1, P - PD), by_recency=st.booleans(), jit=st.booleans())
    def spill_cold_pages(self, n, by_recency, jit):
        Counter.operations += 1
        layer = self.layers[0]
        scores = tiers.recency_scores(layer) if by_recency else -tiers.recency_scores(layer)
        pages = tiers.coldest_pages(layer, scores, n)
        before = tiers.tier_counts(self.pool, layer)
        self.pool, self.layers = (spill_jit if jit else tiers.spill)(self.pool, self.layers,
                                                                     pages)
        after = tiers.tier_counts(self.pool, self.layers[0])
        assert after["allocated"] == before["allocated"] == after["device"] + after["host"]
        self.learn_tiers()

    @rule(bits=st.integers(0, 2 ** (P - PD) - 1))
    def restore_pages(self, bits):
        Counter.operations += 1
        pages = np.array([PD + i if (bits >> i) & 1 else tiers.NO_PAGE for i in range(P - PD)])
        self.pool, self.layers = restore_jit(self.pool, self.layers, jnp.asarray(pages,
                                                                                 jnp.int32))
        self.learn_tiers()

    @rule(drop=st.integers(0, P - PD))
    def prefetch_pages(self, drop):
        """Stage the host pages rows read, leaving `drop` of them out (misses)."""
        Counter.operations += 1
        pages = tiers.host_pages_in_use(self.layers[0])
        pages = jnp.where(jnp.arange(pages.shape[0]) < drop, tiers.NO_PAGE, pages)
        self.layers = tiers.prefetch(self.layers, pages)

    @rule(value=st.sampled_from([np.nan, np.inf, -np.inf, 1e30]), shift=st.integers(-3, 40))
    def plant_garbage(self, value, shift):
        Counter.operations += 1
        pages = unread_pages(self.layers[0])
        self.layers = plant_tiered(self.layers, jnp.asarray(pages), jnp.float32(value),
                                   jnp.arange(S, dtype=jnp.int32) + shift)

    @rule(bad=st.sampled_from([-2, 0, PD - 1, P, P + 5, 2 ** 31 - 1]),
          to_host=st.booleans(), jit=st.booleans())
    def refuse_out_of_range_pages(self, bad, to_host, jit):
        """A page id outside the tier a move reads from is an error, never a silent skip (the
        null page and host pages for `spill`, device pages for `restore`, ids beyond the
        pool for both): a ValueError for host ids, and under jit the pool's error record
        (codes 9, 10) with nothing moved for that id."""
        Counter.operations += 1
        if to_host and 1 <= bad < PD or not to_host and PD <= bad < P:
            return  # in range for this move
        pages = np.array([tiers.NO_PAGE, bad], np.int32)
        move = tiers.spill if to_host else tiers.restore
        if not jit:
            with pytest.raises(ValueError, match="out of range"):
                move(self.pool, self.layers, pages)
            return
        before = jax.device_get(self.snapshot(self.pool, self.layers))
        self.pool, self.layers = (spill_jit if to_host else restore_jit)(
            self.pool, self.layers, jnp.asarray(pages, jnp.int32))
        self.expect_pool_error((9 if to_host else 10, 1, bad, PD if to_host else P))
        after = jax.device_get(self.snapshot(self.pool, self.layers))
        jax.tree.map(np.testing.assert_array_equal, after, before)

    @rule(bad=st.sampled_from([-2, P, P + 5]))
    def prefetch_out_of_range_ids(self, bad):
        """Ids from a device array are not read back before the copies start (that would wait
        for them): one outside the pool leaves its stage slot empty and sets the layers'
        error record (code 11), which `check_pool` reports."""
        Counter.operations += 1
        pages = tiers.host_pages_in_use(self.layers[0]).at[0].set(bad)
        self.layers = tiers.prefetch(self.layers, pages)
        for layer in self.layers:
            np.testing.assert_array_equal(np.asarray(layer.error), (11, 0, bad, P))
            assert int(layer.stage_ids[0]) == tiers.NO_PAGE
        with pytest.raises(ValueError, match=r"prefetch: pages\[0\] = %d is out of range" % bad):
            check_pool(self.pool, self.layers)
        self.layers = tuple(layer.replace(error=ZERO4) for layer in self.layers)

    def release_rows(self, rows):
        super().release_rows(rows)
        self.learn_tiers()



def test_tiered_pool_against_shadow_model():
    """A page spilled (and staged, and restored) by one sequence is never readable by another:
    every row reads exactly what it wrote or inherited, through both tiers and the stage."""
    Counter.operations = 0
    run_state_machine_as_test(TieredPoolMachine, settings=machine_settings(30, 40))
    print(f"{Counter.operations} tiered pool operations against the shadow model")
    assert Counter.operations >= fewest_operations(1000), Counter.operations


# ---------------------------------------------------------------------------------------------
# Paged KIVI (issue 49): the same operations over KIVI groups in tiered pages, against the
# unpaged KIVI cache given the same writes. Fork and release act on the unpaged reference row
# by row (copy a row, mark a row EMPTY); evicting a page marks its tokens EMPTY there.

import kvjax  # noqa: E402
from kvjax.memory import paged_kivi  # noqa: E402

KG, KRES, KD, KNP, KPD, KHOST = 4, 4, 8, 5, 14, 6  # group = page, residual, head dim, pages
KCAP = 160  # the reference's room: every token the longest run flushes


@jax.jit
def kivi_write(layer, k, v, pos):
    return kvjax.write(layer, k, v, pos)


@jax.jit
def reference_rows(ref, src, cleared):
    """The unpaged reference with row b copied from row src[b], then rows `cleared` [B] EMPTY."""
    rows = (src[:, None] * KVH + jnp.arange(KVH)).reshape(-1)

    def copy(x):
        if x.ndim >= 2 and x.shape[:2] == (B, KVH):
            return x[src]
        return x[rows] if x.ndim >= 1 and x.shape[0] == B * KVH else x
    ref = jax.tree.map(copy, ref)
    gone = lambda pos: jnp.where(cleared[:, None, None], EMPTY, pos)
    return ref.replace(body=ref.body.replace(pos=gone(ref.body.pos)),
                       recent=ref.recent.replace(pos=gone(ref.recent.pos)))


@jax.jit
def reference_forget(ref, forget):
    """The reference with positions forget [B, KVH, N] (EMPTY-padded) EMPTY in its body."""
    hit = jnp.any(ref.body.pos[..., None] == jnp.where(forget == EMPTY, -7, forget)[:, :, None],
                  -1)
    return ref.replace(body=ref.body.replace(pos=jnp.where(hit, EMPTY, ref.body.pos)))


@jax.jit
def kivi_views(layer, ref):
    paged, want = layer.view(), ref.view()
    return dict(k=paged.k, v=paged.v, pos=paged.pos, want_k=want.k, want_v=want.v,
                want_pos=want.pos, lengths=layer.body.lengths)


@jax.jit
def plant_kivi(layer, pages, value, pos):
    """Garbage into both tiers' unread pages [P] of a paged KIVI body: float leaves `value`,
    code words all ones, positions `pos` [KG]."""
    body = layer.body
    n_dev = body.device_pages

    def spoil(store, mask, to_host):
        def leaf(x):
            bad = jnp.full_like(x, -1) if jnp.issubdtype(x.dtype, jnp.integer) else \
                (jnp.ones_like(x) * value).astype(x.dtype)
            m = mask.reshape(mask.shape + (1,) * (x.ndim - 1))
            if to_host:
                return tiers._to_host(jnp.where(m, bad, tiers._to_device(x)))
            return jnp.where(m, bad, x)
        return store.replace(**{f: leaf(getattr(store, f)) for f in store.slot_fields
                                if getattr(store, f) is not None})
    dev, host = pages[:n_dev], pages[n_dev:]
    body = body.replace(k=spoil(body.k, dev, False), v=spoil(body.v, dev, False),
                        host_k=spoil(body.host_k, host, True),
                        host_v=spoil(body.host_v, host, True),
                        pos=jnp.where(pages[:, None, None], pos[None, None, :], body.pos))
    return layer.replace(body=body)


kivi_fork_jit, kivi_release_jit = jax.jit(paged_kivi.fork), jax.jit(paged_kivi.release)


class PagedKiviMachine(RuleBasedStateMachine):
    """One paged KIVI layer (tiered body) and its unpaged reference, driven by the same
    writes. After every operation `check_pool` passes, each row's body length is the shadow's,
    and every (sequence, KV head) reads exactly the reference's tokens: the same positions in
    the same order, the same decoded keys and values bit for bit, nothing non-finite."""

    @initialize()
    def start(self):
        t = kvjax.kivi(bits=4, group=KG, residual=KRES)
        empty = (kvjax.init_cache(B, KVH, KCAP, KD),)
        (self.ref,), _ = t.update(empty, t.init(empty), None)
        self.pool, (self.layer,) = paged_kivi.from_residual(
            (self.ref,), max_pages=KNP, device_pages=KPD, host_pages=KHOST)
        self.body_slots = np.zeros((B, KVH), int)  # what each row's body length must be
        self.next_pos = [0] * B
        self.rng = np.random.default_rng(0)

    def clear_flags(self):
        self.pool = self.pool.replace(error=ZERO4, overflow=jnp.zeros((), bool))

    def busy(self, b):
        exact = np.asarray(self.ref.recent.pos)[b] != EMPTY
        return bool(self.body_slots[b].any() or exact.any())

    @rule(t=st.sampled_from([1, 2, 3]), padding=st.lists(st.booleans(), min_size=9, max_size=9),
          jit=st.booleans())
    def reserve_then_write(self, t, padding, jit):
        Counter.operations += 2
        moved = np.asarray(paged_kivi.flush_tokens((self.layer,)))
        self.pool, (body,) = (reserve_jit if jit else reserve)(self.pool, (self.layer.body,),
                                                               jnp.asarray(moved))
        if bool(self.pool.overflow):  # no room: nothing was allocated, nothing is written
            self.clear_flags()
            return
        self.layer = self.layer.replace(body=body)
        real = ~np.asarray(padding[:B * t], bool).reshape(B, t)
        pos = np.full((B, t), EMPTY, np.int32)
        for b in range(B):
            for i in np.nonzero(real[b])[0]:
                pos[b, i], self.next_pos[b] = self.next_pos[b], self.next_pos[b] + 1
        k, v = self.rng.integers(-8, 9, (2, B, KVH, t, KD)).astype(np.float32)
        k, v, pos = jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos)
        self.layer, self.ref = kivi_write(self.layer, k, v, pos), kivi_write(self.ref, k, v, pos)
        self.body_slots += moved[:, None]
        np.testing.assert_array_equal(np.asarray(self.layer.body.error), ZERO4)

    @rule(dst=st.integers(0, B - 1), source=st.integers(0, B - 1), first=st.booleans(),
          jit=st.booleans())
    def fork_sequence(self, dst, source, first, jit):
        Counter.operations += 1
        if first:
            self.release_rows(np.arange(B) == dst)
        src = np.full(B, -1, np.int32)
        src[dst] = source
        refused = self.busy(dst)
        self.pool, (self.layer,) = (kivi_fork_jit if jit else paged_kivi.fork)(
            self.pool, (self.layer,), jnp.asarray(src))
        assert bool(self.pool.overflow) == refused
        if refused:
            assert int(self.pool.error[0]) == 4 and int(self.pool.error[1]) == dst
            self.clear_flags()
            return
        np.testing.assert_array_equal(np.asarray(self.pool.error), ZERO4)
        take = np.where(src >= 0, src, np.arange(B))
        self.ref = reference_rows(self.ref, jnp.asarray(take), jnp.zeros(B, bool))
        self.body_slots[dst] = self.body_slots[source]
        self.next_pos[dst] = self.next_pos[source]

    def release_rows(self, rows):
        self.pool, (self.layer,) = kivi_release_jit(self.pool, (self.layer,), jnp.asarray(rows))
        self.ref = reference_rows(self.ref, jnp.arange(B), jnp.asarray(rows))
        for b in np.nonzero(rows)[0]:
            self.body_slots[b], self.next_pos[b] = 0, 0

    @rule(rows=st.lists(st.booleans(), min_size=B, max_size=B))
    def release_sequences(self, rows):
        Counter.operations += 1
        self.release_rows(np.asarray(rows, bool))

    @rule(bits=st.integers(0, 2 ** (B * KVH * KNP) - 1))
    def evict(self, bits):
        """Drop whole groups (pages): the reference forgets their tokens."""
        Counter.operations += 1
        drop = np.array([(bits >> i) & 1 for i in range(B * KVH * KNP)], bool).reshape(
            B, KVH, KNP)
        used = self.body_slots // KG
        drop &= np.arange(KNP) < used[..., None] - 1  # in use, not the last written page
        pages = paged_kivi.unpaged_groups(self.layer)["pos"]  # [R, KNP*KG] table order
        forget = np.where(np.repeat(drop, KG, -1).reshape(B * KVH, -1), np.asarray(pages), EMPTY)
        self.pool, (body,) = evict_jit(self.pool, (self.layer.body,), jnp.asarray(drop))
        self.layer = self.layer.replace(body=body)
        self.ref = reference_forget(self.ref, jnp.asarray(forget.reshape(B, KVH, -1)))
        self.body_slots -= KG * drop.sum(-1)

    @rule(n=st.integers(1, KHOST), by_recency=st.booleans())
    def spill_cold_pages(self, n, by_recency):
        Counter.operations += 1
        body = self.layer.body
        scores = tiers.recency_scores(body) if by_recency else -tiers.recency_scores(body)
        self.pool, (body,) = spill_jit(self.pool, (body,), tiers.coldest_pages(body, scores, n))
        self.layer = self.layer.replace(body=body)

    @rule(bits=st.integers(0, 2 ** KHOST - 1))
    def restore_pages(self, bits):
        Counter.operations += 1
        pages = np.array([KPD + i if (bits >> i) & 1 else tiers.NO_PAGE for i in range(KHOST)])
        self.pool, (body,) = restore_jit(self.pool, (self.layer.body,),
                                         jnp.asarray(pages, jnp.int32))
        self.layer = self.layer.replace(body=body)

    @rule(drop=st.integers(0, KHOST))
    def prefetch_pages(self, drop):
        Counter.operations += 1
        pages = tiers.host_pages_in_use(self.layer.body)
        pages = jnp.where(jnp.arange(pages.shape[0]) < drop, tiers.NO_PAGE, pages)
        (body,) = tiers.prefetch((self.layer.body,), pages)
        self.layer = self.layer.replace(body=body)

    @rule(value=st.sampled_from([np.nan, np.inf, -np.inf, 1e30]), shift=st.integers(-3, 40))
    def plant_garbage(self, value, shift):
        Counter.operations += 1
        pages = unread_pages(self.layer.body)
        self.layer = plant_kivi(self.layer, jnp.asarray(pages), jnp.float32(value),
                                jnp.arange(KG, dtype=jnp.int32) + shift)

    @rule(b=st.integers(0, B - 1), bad=st.sampled_from([-2, B, B + 7]))
    def fork_bad_source(self, b, bad):
        Counter.operations += 1
        src = np.full(B, -1, np.int32)
        src[b] = bad
        with pytest.raises(ValueError, match=rf"source\[{b}\] = {bad}"):
            paged_kivi.fork(self.pool, (self.layer,), src)

    @invariant()
    def rows_read_the_reference(self):
        if not hasattr(self, "pool"):
            return
        check_pool(self.pool, (self.layer.body,))
        got = jax.device_get(kivi_views(self.layer, self.ref))
        np.testing.assert_array_equal(got["lengths"], self.body_slots)
        assert np.isfinite(got["k"]).all() and np.isfinite(got["v"]).all()
        for b in range(B):
            for h in range(KVH):
                r = b * KVH + h
                mine, want = got["pos"][b, h] != EMPTY, got["want_pos"][b, h] != EMPTY
                np.testing.assert_array_equal(got["pos"][b, h][mine], got["want_pos"][b, h][want])
                np.testing.assert_array_equal(got["k"][r][mine], got["want_k"][r][want])
                np.testing.assert_array_equal(got["v"][r][mine], got["want_v"][r][want])


def test_paged_kivi_pool_against_the_unpaged_cache():
    """KIVI pages through write/flush, fork, release, page eviction, spill, restore, prefetch
    and garbage in unread pages: every row reads what the unpaged KIVI cache holds."""
    Counter.operations = 0
    run_state_machine_as_test(PagedKiviMachine, settings=machine_settings(25, 40))
    print(f"{Counter.operations} paged KIVI operations against the unpaged cache")
    assert Counter.operations >= fewest_operations(800), Counter.operations
