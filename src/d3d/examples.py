"""The training set as d3d.train and d3d.prune read it (docs/design.md, Training: the input pipeline).

- On disk: the responses folder's jsonl shards are converted once into `examples.arrow` beside them
  (token ids, prompt length, id, backend; keyed by the shards' names, sizes and content hashes,
  rebuilt when one changes: `cache_is_current`). Every rank memory-maps that file: no rank parses the folder or holds the set in
  Python objects (~45 bytes a token as lists of ints; 4 here, shared through the page cache).
- The order: a pure function of (seed, epoch), computed once per epoch and cached; with
  `train.length_grouping` each window of that many global batches is sorted by length and cut
  into steps, so a micro-batch pads to a width its rows nearly share.
- The batches: `StepBatches[step]` is one process's packed micro-batches of a step, so a DataLoader's
  workers pack ahead of the training loop (`StepLoader`); anchors come from a generator seeded by
  (seed, step, slice of the global batch), whichever process or worker packs them.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from d3d.errors import ConfigError
from d3d.objective import Example, ObjectiveConfig, PackedBatch, pack
from d3d.specs import StepSettings
from d3d.utils.io import resolve_path

CACHE_FILE = "examples.arrow"
CACHE_FORMAT = 3  # bump when the columns or the key change: an older cache is then rebuilt
ROWS_PER_BATCH = 8192  # rows per Arrow record batch while converting: bounds the converter's memory


# ---------------------------------------------------------------------------- the Arrow cache


def shards(responses_dir: Path) -> list[Path]:
    """The folder's response files (one per generating process; d3d.data.responses)."""
    return sorted(responses_dir.glob("responses.rank*.jsonl"))


def _identity(path: Path) -> list[int]:
    """What changes whenever a file's bytes do, read without its bytes: inode, size, mtime and ctime.
    `cp -p` and `rsync -a` keep a copy's size and mtime, but no copy or write keeps its ctime."""
    st = path.stat()
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def content_hash(path: Path) -> str:
    """A hash of a file's bytes (blake2b, read in 16 MiB pieces: about a second a GB)."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while piece := f.read(16 << 20):
            digest.update(piece)
    return digest.hexdigest()


def shards_key(responses_dir: Path) -> str:
    """What the cache is built from: each shard's name, size and content hash, and the identity it had
    when hashed. A generate run that appended rows, or a shard replaced or edited in place, changes
    it, whatever mtime the new bytes carry."""
    files = shards(responses_dir)
    identities = [_identity(p) for p in files]  # before the bytes: a write while hashing shows later
    return json.dumps({"format": CACHE_FORMAT, "shards": [[p.name, i[1], content_hash(p), i]
                                                          for p, i in zip(files, identities)]})


def cache_is_current(key: str, responses_dir: Path) -> bool:
    """Whether a cache built under `key` holds the folder's rows now. A shard whose identity is the one
    it had when hashed is unchanged and is not read; one whose identity changed (written, or the
    folder copied) is hashed again and compared: a copy keeps the cache, an edit rebuilds it."""
    try:
        built = json.loads(key)
    except ValueError:
        return False
    files = shards(responses_dir)
    if not isinstance(built, dict) or built.get("format") != CACHE_FORMAT:
        return False
    if [entry[0] for entry in built["shards"]] != [p.name for p in files]:
        return False
    for (_, size, digest, identity), path in zip(built["shards"], files):
        now = _identity(path)
        if now[1] != size or (now != identity and content_hash(path) != digest):
            return False
    return True


def _schema(key: str | None = None):
    import pyarrow as pa

    return pa.schema([("id", pa.string()), ("ids", pa.list_(pa.int32())), ("prompt_len", pa.int32()),
                      ("backend", pa.string()), ("looping", pa.bool_())], metadata={"d3d_key": key} if key else None)


def _write_rows(writer, rows: list[dict]) -> None:
    import pyarrow as pa

    from d3d.data.responses import is_looping, row_backend

    columns = {"id": [r["id"] for r in rows], "ids": [r["prompt_ids"] + r["response_ids"] for r in rows],
               "prompt_len": [len(r["prompt_ids"]) for r in rows],
               "backend": [row_backend(r) for r in rows],
               "looping": [is_looping(r) for r in rows]}  # train.drop_looping reads it
    writer.write_batch(pa.record_batch(columns, schema=_schema()))


def build_cache(responses_dir: Path, key: str) -> Path:
    """Convert the shards into one Arrow file sorted by id, each id once, as read_responses reads
    them: a shard's repeated row counts once, and a prompt two shards answer differently is
    refused (ConflictingShards). Two streaming passes: rows in file order into a scratch file,
    then that file taken in id order. Written aside and renamed: a kill leaves no half cache."""
    import pyarrow as pa

    from d3d.data.responses import RESPONSE_KEYS, ConflictingShards
    from d3d.utils.io import read_jsonl

    out = responses_dir / CACHE_FILE
    scratch, tmp = out.with_suffix(f".scratch.{os.getpid()}"), out.with_suffix(f".partial.{os.getpid()}")
    names = [p.name for p in shards(responses_dir)]
    try:
        shard_of = []  # the shard of each scratch row
        with pa.OSFile(str(scratch), "wb") as sink, pa.ipc.new_file(sink, _schema()) as writer:
            rows = []
            for s, name in enumerate(names):
                for row in read_jsonl(responses_dir / name, RESPONSE_KEYS):
                    rows.append(row)
                    shard_of.append(s)
                    if len(rows) == ROWS_PER_BATCH:
                        _write_rows(writer, rows)
                        rows = []
            if rows:
                _write_rows(writer, rows)
        raw = pa.ipc.open_file(pa.memory_map(str(scratch))).read_all()
        ids, first = raw.column("ids"), {}
        for i, row_id in enumerate(raw.column("id").to_pylist()):
            j = first.setdefault(row_id, i)
            if shard_of[j] != shard_of[i] and ids[j] != ids[i]:
                raise ConflictingShards(
                    f"{responses_dir}: prompt {row_id!r} has different responses in {names[shard_of[j]]} and "
                    f"{names[shard_of[i]]} (two generation runs overlapped on this folder). Fix: delete the shard "
                    "files of one run, or generate into a new folder.")
        order = np.array([first[k] for k in sorted(first)], dtype=np.int64)
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, _schema(key)) as writer:
            for s in range(0, len(order), ROWS_PER_BATCH):
                writer.write_table(raw.take(order[s : s + ROWS_PER_BATCH]))
        del raw, ids
        os.replace(tmp, out)
    finally:
        scratch.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return out


def open_cache(responses_dir: Path):
    """The folder's Arrow table, memory-mapped; (re)built first when it is missing or stale."""
    import pyarrow as pa

    path = responses_dir / CACHE_FILE
    if path.is_file():
        table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
        if cache_is_current((table.schema.metadata or {}).get(b"d3d_key", b"").decode(), responses_dir):
            return table
    if not os.access(responses_dir, os.W_OK):
        raise ConfigError(f"{responses_dir} is read-only and its training cache ({CACHE_FILE}) is missing or older than "
                          "its responses. Fix: copy the folder somewhere writable and set train.responses_dir there.")
    return pa.ipc.open_file(pa.memory_map(str(build_cache(responses_dir, shards_key(responses_dir))))).read_all()


# ---------------------------------------------------------------------------- the set


class ExampleSet(Sequence):
    """Examples (prompt + response ids cut to max_len) read from the memory-mapped cache on access.

    `rows` are the table rows it holds (sorted by id); `lengths` their token counts. Slicing gives
    another ExampleSet over the same file; pickling carries the path, not the tokens (DataLoader
    workers started by spawn reopen the map). `orders` caches the epoch orders batch_at computed."""

    def __init__(self, path: Path, rows: np.ndarray, max_len: int, table=None):
        self.path, self.rows, self.max_len = Path(path), np.asarray(rows, dtype=np.int64), max_len
        self._open(table)

    def _open(self, table=None) -> None:
        import pyarrow as pa

        table = table if table is not None else pa.ipc.open_file(pa.memory_map(str(self.path))).read_all()
        # one (values, offsets) pair per record batch, as numpy views of the mapped file (no copy)
        chunks = table.column("ids").chunks
        self._values = [c.values.to_numpy(zero_copy_only=True) for c in chunks]
        offsets = [c.offsets.to_numpy(zero_copy_only=True) for c in chunks]
        # per table row: its record batch, and where its ids begin and end in that batch's values
        chunk = np.repeat(np.arange(len(chunks)), [len(c) for c in chunks])
        begin = np.concatenate([o[:-1] for o in offsets]).astype(np.int64)
        end = np.concatenate([o[1:] for o in offsets]).astype(np.int64)
        self._chunk, self._begin = chunk[self.rows], begin[self.rows]
        self.lengths = np.minimum(end[self.rows] - self._begin, self.max_len)
        self.prompt_lens = table.column("prompt_len").to_numpy()[self.rows]
        self.orders: dict = {}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.subset(np.arange(len(self))[i])
        if i < 0:
            i += len(self)
        b = self._begin[i]
        ids = self._values[self._chunk[i]][b : b + self.lengths[i]].tolist()
        return Example(ids, int(self.prompt_lens[i]))

    def subset(self, positions: np.ndarray) -> "ExampleSet":
        """The examples at these positions (of this set), as a set over the same file."""
        return ExampleSet(self.path, self.rows[positions], self.max_len)

    def fingerprint(self) -> str:
        """A hash of what training reads from this set: each example's tokens (cut to max_len) and
        prompt length, in order. It does not change when the folder is copied (unlike
        the shards' inodes and times), and changes when any response, or the set of responses, does."""
        digest = hashlib.sha256(np.stack([self.lengths, self.prompt_lens]).astype(np.int64).tobytes())
        for chunk, begin, length in zip(self._chunk, self._begin, self.lengths):
            digest.update(self._values[chunk][begin : begin + length].tobytes())
        return digest.hexdigest()[:32]

    def __getstate__(self) -> dict:
        return {"path": self.path, "rows": self.rows, "max_len": self.max_len}

    def __setstate__(self, state: dict) -> None:
        self.path, self.rows, self.max_len = state["path"], state["rows"], state["max_len"]
        self._open()


def load_examples(responses_dir: Path, max_len: int, allow_mixed_backends: bool = False,
                  drop_looping: bool = False) -> ExampleSet:
    """(prompt + response) token ids of every response row, cut to max_len, sorted by id: rows with
    no response token left after the cut are dropped, and with `drop_looping` the rows whose
    response ends in a repetition loop (d3d.data.responses.is_looping)."""
    responses_dir = Path(responses_dir)
    if not shards(responses_dir):
        raise ConfigError(
            f"no target responses in {responses_dir}. Fix: run `python -m d3d.generate` with the same "
            "target and data first (or set train.responses_dir)."
        )
    table = open_cache(responses_dir)
    counts = table.column("backend").value_counts().to_pylist()
    backends = {c["values"]: c["counts"] for c in counts}
    if len(backends) > 1 and not allow_mixed_backends:  # an engine's bf16 rows are another distribution
        listed = ", ".join(f"{n} rows from {b}" for b, n in sorted(backends.items()))
        raise ConfigError(f"{responses_dir} mixes responses of several generation backends ({listed}). Fix: "
                          "train on one backend's folder, or set train.allow_mixed_backends=true to use them all.")
    every = ExampleSet(responses_dir / CACHE_FILE, np.arange(table.num_rows), max_len, table)
    kept = every.lengths > every.prompt_lens
    if drop_looping:
        kept &= ~table.column("looping").to_numpy(zero_copy_only=False)
    keep = np.nonzero(kept)[0]
    if not len(keep):
        raise ConfigError(f"no response in {responses_dir} has a token left within train.max_len={max_len}. "
                          "Fix: raise train.max_len.")
    return every.subset(keep)


def split_examples(examples: ExampleSet, val_size: int, seed: int) -> tuple[ExampleSet, ExampleSet]:
    """A seeded held-out split, each part in id order. The shuffle is the one d3d has always used, so
    a drafter trained before keeps its held-out responses held out (prune's calibration reads them)."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    val, train = (np.sort(np.array(part, dtype=np.int64)) for part in (order[:val_size], order[val_size:]))
    if not len(train):
        raise ConfigError(f"train.val_size={val_size} holds out all {len(examples)} responses, leaving none for "
                          f"training. Fix: set train.val_size below {len(examples)} (a few percent of the responses), "
                          f"or generate more responses (generate.limit, data.limit).")
    return examples.subset(train), examples.subset(val)


class Split(NamedTuple):
    examples: ExampleSet  # every response row kept (the training data's fingerprint is taken of these)
    train: ExampleSet
    val: ExampleSet  # the held-out responses: τ in training, pruning's calibration, export's and the scripts' τ


def held_out(tc: StepSettings, seed: int) -> Split:
    """d3d.train's split, the one every job and script reads its held-out responses from. Everything
    that decides which responses are held out is read here, from the train.* settings: the rows of
    train.responses_dir cut to train.max_len (one generation backend unless train.allow_mixed_backends,
    loops left out with train.drop_looping), then train.val_size of them held out by a shuffle seeded
    with `seed`. A script that built the split itself measured its held-out τ on other responses as
    soon as one of these settings was not the default."""
    examples = load_examples(resolve_path(tc.responses_dir), tc.max_len, tc.allow_mixed_backends, tc.drop_looping)
    return Split(examples, *split_examples(examples, tc.val_size, seed))


# ---------------------------------------------------------------------------- the order


def epoch_order(n: int, seed: int, epoch: int, lengths: np.ndarray | None = None, per_step: int = 1,
                grouping: int = 0) -> np.ndarray:
    """The examples' order in one epoch: a seeded permutation. With `grouping` (windows of that many
    global batches of `per_step` examples), each window is sorted by length and cut into steps whose
    order is shuffled: a step's micro-batches hold neighbours in length (little padding) and every
    rank of a step gets a similar length (no straggler). Windows start at step boundaries of the
    global position (`epoch * n` need not be one): the step an epoch's end leaves unfinished is
    completed by the next epoch's sorted head."""
    shuffled = list(range(n))  # the shuffle d3d has always used: a run started before resumes on its order
    random.Random(seed * 7919 + epoch).shuffle(shuffled)
    order = np.array(shuffled, dtype=np.int64)
    if not grouping:
        return order
    rng = np.random.default_rng([seed, epoch])
    by_length = lambda idx: idx[np.argsort(lengths[idx], kind="stable")]
    head = (-epoch * n) % per_step
    parts = [by_length(order[:head])]
    window = grouping * per_step
    for s in range(head, n, window):
        sorted_window = by_length(order[s : s + window])
        full = len(sorted_window) // per_step
        parts += [sorted_window[k * per_step : (k + 1) * per_step] for k in rng.permutation(full)]
        parts.append(sorted_window[full * per_step :])  # a partial step stays last: it meets the next epoch's head
    return np.concatenate(parts)


def lengths_of(train: Sequence) -> np.ndarray:
    return train.lengths if isinstance(train, ExampleSet) else np.array([len(e.ids) for e in train])


def batch_at(train: Sequence, step: int, micro: int, per_step: int, batch_size: int, seed: int,
             rank: int = 0, ranks: int = 1, grouping: int = 0) -> list:
    """The micro-batch of a given step on one process: data order is a pure function of (seed,
    position), so a resumed run reads exactly what the uninterrupted run would have read. A step
    reads per_step = batch_size * grad_accum * ranks examples; each (micro, rank) its own slice.
    An ExampleSet keeps the epoch orders it needed (the last few), so each is computed once."""
    start = step * per_step + (micro * ranks + rank) * batch_size
    cache = train.orders if isinstance(train, ExampleSet) else {}
    out = []
    for i in range(start, start + batch_size):
        epoch, idx = divmod(i, len(train))
        key = (seed, epoch, per_step, grouping)
        if key not in cache:
            while len(cache) >= 3:  # a batch touches at most two epochs
                cache.pop(next(iter(cache)))
            cache[key] = epoch_order(len(train), seed, epoch, lengths_of(train) if grouping else None,
                                     per_step, grouping)
        out.append(train[int(cache[key][idx])])
    return out


# ---------------------------------------------------------------------------- the batches


def anchor_generator(seed: int, step: int, piece: int) -> torch.Generator:
    """The generator of one slice (`piece` = micro * ranks + rank) of a step's global batch: the
    anchors of that slice are the same whichever process, micro-batch or worker packs it."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 4_099 + piece)


class StepBatches(torch.utils.data.Dataset):
    """Item `step`: this process's packed micro-batches of that optimizer step (grad_accum of them)."""

    def __init__(self, train: Sequence, objective: ObjectiveConfig, mask_id: int, pad_id: int, seed: int,
                 batch_size: int, grad_accum: int, grouping: int, steps: int, rank: int = 0, ranks: int = 1):
        self.train, self.objective, self.mask_id, self.pad_id, self.seed = train, objective, mask_id, pad_id, seed
        self.batch_size, self.grad_accum, self.grouping, self.steps = batch_size, grad_accum, grouping, steps
        self.rank, self.ranks = rank, ranks

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int) -> list[PackedBatch]:
        per_step = self.batch_size * self.grad_accum * self.ranks  # the global batch of one optimizer step
        return [pack(batch_at(self.train, step, micro, per_step, self.batch_size, self.seed, self.rank, self.ranks,
                              self.grouping),
                     self.objective, self.mask_id, self.pad_id, anchor_generator(self.seed, step, micro * self.ranks + self.rank))
                for micro in range(self.grad_accum)]


def _as_is(item):
    return item


class StepLoader:
    """The steps of a StepBatches from `start` on, packed by `num_workers` DataLoader workers ahead
    of the loop (0: in the loop's process, as a check of determinism reads them). `next_step` is
    the step the next `next()` returns."""

    def __init__(self, batches: StepBatches, start: int, num_workers: int):
        loader = torch.utils.data.DataLoader(batches, batch_size=None, sampler=range(start, len(batches)),
                                             num_workers=num_workers, collate_fn=_as_is)
        self._it, self.next_step = iter(loader), start

    def __next__(self) -> list[PackedBatch]:
        self.next_step += 1
        return next(self._it)

    def __iter__(self):
        return self
