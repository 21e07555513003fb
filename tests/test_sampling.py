"""Epoch order, mixtures, packing numbers, prefetching and the saved position, on prepared HornMT text."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from shared_data import DATA_DIR

from hopperlm.config import DataConfig
from hopperlm.data.batches import BatchLayout, train_batches
from hopperlm.data.loader import RandomWindows, TokenShards
from hopperlm.data.packing import window_doc_ids
from hopperlm.data.prepare import PrepareOptions, prepare
from hopperlm.data.sampling import SampleStream, Source
from hopperlm.data.shards import read_manifest
from hopperlm.data.train_data import resolve_datasets
from hopperlm.errors import DataError

T = 48


def prepare_lines(src: Path, out: Path) -> Path:
    lines = [line for line in src.read_text(encoding="utf-8").splitlines() if line.strip()]
    jsonl = out.parent / f"{out.name}.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines), encoding="utf-8")
    prepare([jsonl], out, PrepareOptions(shard_tokens=40_000), progress=False)
    return out


@pytest.fixture(scope="module")
def tir(tmp_path_factory) -> Path:
    return prepare_lines(DATA_DIR / "hornmt" / "tir.txt", tmp_path_factory.mktemp("s") / "tir")


@pytest.fixture(scope="module")
def eng(tmp_path_factory) -> Path:
    return prepare_lines(DATA_DIR / "hornmt" / "eng.txt", tmp_path_factory.mktemp("s") / "eng")


def stream(paths, micro=4, rank=0, world=1, order="sequential", weights=None, packing=False, shuffle=True):
    weights = weights or [1.0] * len(paths)
    sources = [Source(p.name, TokenShards(p, "train"), w) for p, w in zip(paths, weights, strict=True)]
    return SampleStream(
        sources, T, micro, seed=7, order=order, shuffle=shuffle, packing=packing, rank=rank, world_size=world
    )


def test_sequential_epochs_visit_every_window_once(eng):
    s = stream([eng], micro=8)
    windows = s.orders[0].windows
    seen = []
    while len(seen) < 2 * windows:
        seen.extend(s.orders[0].start(k) for k in range(len(seen), len(seen) + 8))
        s.next_batch()
    first, second = seen[:windows], seen[windows : 2 * windows]
    assert sorted(first) == sorted(second) == [i * T for i in range(windows)]
    assert first != second  # a new shuffle per epoch
    plain = stream([eng], micro=8, shuffle=False)
    x = plain.next_batch().x
    want = torch.from_numpy(TokenShards(eng, "train").read(0, 8 * T + 1))
    assert torch.equal(x.flatten(), want[:-1].reshape(8, T).flatten())


def test_resume_continues_with_exactly_the_next_samples(tir, eng):
    a = stream([tir, eng], weights=[0.7, 0.3], packing=True)
    for _ in range(5):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # through JSON, like a checkpoint's state.json
    want = [a.next_batch() for _ in range(3)]
    b = stream([tir, eng], weights=[0.7, 0.3], packing=True)
    b.load_state_dict(state)
    for w, g in zip(want, [b.next_batch() for _ in range(3)], strict=True):
        assert torch.equal(w.x, g.x) and torch.equal(w.y, g.y) and torch.equal(w.doc_ids, g.doc_ids)
    with pytest.raises(DataError, match="resume with the run's own data config"):
        stream([tir]).load_state_dict(state)


def test_position_does_not_depend_on_world_size(tir, eng):
    """Two ranks of 2 rows each read exactly the 4 rows one rank of 4 reads; a state saved by the two-rank run
    continues on one rank (and back) at the same global sample."""
    ranks = [stream([tir, eng], micro=2, rank=r, world=2, weights=[0.6, 0.4]) for r in range(2)]
    single = stream([tir, eng], micro=4, weights=[0.6, 0.4])
    for _ in range(3):
        parts = [r.next_batch() for r in ranks]
        whole = single.next_batch()
        assert torch.equal(torch.cat([p.x for p in parts]), whole.x)
    assert ranks[0].state_dict() == ranks[1].state_dict() == single.state_dict()
    resumed = stream([tir, eng], micro=4, weights=[0.6, 0.4])
    resumed.load_state_dict(ranks[0].state_dict())  # 2 ranks -> 1 rank
    parts = [r.next_batch() for r in ranks]
    assert torch.equal(resumed.next_batch().x, torch.cat([p.x for p in parts]))
    check = stream([tir, eng], micro=4, weights=[0.6, 0.4])
    check.load_state_dict(resumed.state_dict())
    again = [stream([tir, eng], micro=2, rank=r, world=2, weights=[0.6, 0.4]) for r in range(2)]
    for r in again:
        r.load_state_dict(resumed.state_dict())
    assert torch.equal(torch.cat([r.next_batch().x for r in again]), check.next_batch().x)


def test_mixture_follows_its_weights(tir, eng):
    s = stream([tir, eng], micro=50, weights=[0.7, 0.3], order="random")
    for _ in range(40):
        s.next_batch()
    share = s.counts[0] / sum(s.counts)
    assert sum(s.counts) == 2000 and abs(share - 0.7) < 0.03, s.counts
    # Tigrinya rows are Ge'ez script bytes (0xE1 0x88..): rows come from the right dataset
    batch = stream([tir, eng], micro=64, weights=[0.5, 0.5], order="random").next_batch()
    ethiopic = (batch.x == 0xE1).float().mean(dim=1) > 0.1
    assert 10 < int(ethiopic.sum()) < 54


def test_packing_numbers_follow_document_ends(eng):
    shards = TokenShards(eng, "train")
    windows = RandomWindows(shards, T, 32, seed=3, packing=True)
    batch = windows.get(5, 0)
    assert torch.equal(batch.x, windows.batch(5, 0)[0])  # packing adds numbers, never changes the tokens
    after_eos = torch.zeros_like(batch.x, dtype=torch.bool)
    after_eos[:, 1:] = batch.x[:, :-1] == 256
    changes = torch.zeros_like(after_eos)
    changes[:, 1:] = batch.doc_ids[:, 1:] != batch.doc_ids[:, :-1]
    assert torch.equal(changes, after_eos) and after_eos.any()
    assert (batch.doc_ids[:, 0] == 0).all()
    assert RandomWindows(shards, T, 32, seed=3).get(5, 0).doc_ids is None
    # the fast path (after every EOS) agrees with the per-shard document index
    assert shards.eos_marks_documents
    from_index = np.stack([window_doc_ids(shards, int(s), T) for s in windows.starts(5, 0)])
    assert np.array_equal(batch.doc_ids.numpy(), from_index)


def test_literal_eos_in_text_falls_back_to_the_index(tmp_path):
    """TinyLlama's tokenizer turns a literal "</s>" into the EOS id; packing must not split a document there."""
    texts = ["The model printed </s> and went on with the same document.", "A second document.", "Third."]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts * 40))
    tok = DATA_DIR / "tokenizers" / "tinyllama-1.1b-chat-v1.0" / "tokenizer.json"
    manifest = prepare(
        [tmp_path / "d.jsonl"],
        tmp_path / "out",
        PrepareOptions(tokenizer=str(tok), val_fraction=0, doc_format="eos"),
        progress=False,
    )
    assert manifest["eos_marks_documents"] is False
    shards = TokenShards(tmp_path / "out", "train")
    windows = RandomWindows(shards, 40, 8, seed=0, packing=True)
    batch = windows.get(0, 0)
    from_index = np.stack([window_doc_ids(shards, int(s), 40) for s in windows.starts(0, 0)])
    assert np.array_equal(batch.doc_ids.numpy(), from_index)
    eos_count = (batch.x == 2).sum(dim=1)
    doc_changes = batch.doc_ids[:, -1] - batch.doc_ids[:, 0]
    assert (doc_changes < eos_count + 1).all() and (doc_changes < eos_count).any()  # some EOS ids are text


@pytest.mark.parametrize("sampling", ["random", "sequential"])
def test_prefetch_thread_gives_the_same_batches_and_position(tir, sampling):
    cfg = DataConfig(path=str(tir), sampling=sampling, packing=True)
    datasets = resolve_datasets(cfg)
    shards = [TokenShards(tir, "train")]
    same = dict(seq_len=T, layout=BatchLayout(micro_batch=4, grad_accum=2), seed=1, pin=False)
    plain = train_batches(cfg, datasets, shards, **same, prefetch=0)
    ahead = train_batches(cfg, datasets, shards, **same, prefetch=3)
    for step in range(4):
        for micro in range(2):
            a, b = plain.next(step, micro), ahead.next(step, micro)
            assert torch.equal(a.x, b.x) and torch.equal(a.doc_ids, b.doc_ids)
        assert plain.state_dict() == ahead.state_dict()  # what was consumed, not what the thread read ahead
    # an out-of-memory redo: half the rows, twice the micro-steps, the same data from the step's start
    first = plain.next(4, 0)
    assert torch.equal(first.x, ahead.next(4, 0).x)  # then step 4 runs out of memory
    ahead.set_micro_batch(2, 4)
    plain.set_micro_batch(2, 4)
    redo = [ahead.next(4, m) for m in range(4)]
    if sampling == "sequential":  # the stream's samples do not depend on the micro-batch
        assert torch.equal(torch.cat([r.x for r in redo[:2]]), first.x)
    assert torch.equal(torch.cat([r.x for r in redo]), torch.cat([plain.next(4, m).x for m in range(4)]))
    ahead.close()


@pytest.mark.parametrize("prefetch", [0, 3])
def test_a_step_dropped_before_its_first_micro_batch_rewinds_to_its_own_start(tir, prefetch):
    """A signal between steps (during the optimizer step or the logging of step s) drops step s+1 before it
    read anything: the rewind must land at the end of step s, not at the start of step s (which would replay
    step s's data after the resume; a CI run once resumed one step of 128 micro-batches late this way)."""
    cfg = DataConfig(path=str(tir), sampling="sequential", packing=True)
    datasets, shards = resolve_datasets(cfg), [TokenShards(tir, "train")]
    same = dict(seq_len=T, layout=BatchLayout(micro_batch=4, grad_accum=2), seed=1, pin=False)
    whole = train_batches(cfg, datasets, shards, **same, prefetch=prefetch)
    dropped = train_batches(cfg, datasets, shards, **same, prefetch=prefetch)
    for micro in range(2):  # step 0, complete on both
        assert torch.equal(whole.next(0, micro).x, dropped.next(0, micro).x)
    after_step_0 = dropped.state_dict()
    dropped.set_micro_batch(4, 2)  # step 1 dropped at micro-batch 0
    assert dropped.state_dict() == after_step_0
    for micro in range(2):
        assert torch.equal(whole.next(1, micro).x, dropped.next(1, micro).x)
    whole.close()
    dropped.close()


def test_corrupt_index_and_mismatched_manifest_name_the_file(eng, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(eng, copy)
    with open(copy / "train_000001.idx", "r+b") as f:
        f.truncate(8)
    with pytest.raises(
        DataError, match=r"train_000001.idx has 8 bytes but the manifest says \d+ document starts"
    ):
        TokenShards(copy, "train")
    shutil.copy(eng / "train_000001.idx", copy / "train_000001.idx")
    idx = np.fromfile(copy / "train_000001.idx", dtype="<i8")
    idx[-1] = 10**9
    idx.tofile(copy / "train_000001.idx")
    with pytest.raises(DataError, match="train_000001.idx points outside its shard"):
        TokenShards(copy, "train")
    manifest = read_manifest(eng)
    manifest["tokens"]["train"] += 5
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        DataError, match=r"copy/manifest.json: split 'train' says .* does not match its shards"
    ):
        TokenShards(copy, "train")
    manifest["tokens"]["train"] -= 5
    manifest["shards"]["train"][0]["tokens"] -= 1
    manifest["tokens"]["train"] -= 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"train_000000.bin has 80000 bytes but the manifest says 39999"):
        TokenShards(copy, "train")
