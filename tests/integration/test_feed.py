"""The training data partitioned over the replicas (algorithms/feed/): the dispenser's books,
its op on a real socket, replicas streaming through shuffle buffers, every example once
per epoch, and a replica's units handed out again when it dies."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from distbelief.runtime import errors, jobspec
from distbelief.runtime.algorithms.feed import ops
from distbelief.runtime.algorithms.feed.dispenser import Dispenser, DispenserSettings
from distbelief.runtime.algorithms.feed.stream import ShuffleBuffer, StreamedBatches
from distbelief.runtime.algorithms.feed.units import Units
from distbelief.runtime.model.files import FileSet
from distbelief.runtime.wire.protocol import Status

LAYOUT = 0x5EED


# --- the books ---------------------------------------------------------------------------

def test_every_unit_is_handed_out_once_per_epoch_across_replicas():
    units = Units(7, seed=1, lease=10.0)
    seen: dict[int, Counter] = {0: Counter(), 1: Counter()}
    for turn in range(14):
        worker = turn % 3
        epoch, unit = units.hand_out(worker, now=0.0)
        seen[epoch][unit] += 1
        assert units.finish(worker, epoch, unit)
    assert seen[0] == Counter(range(7)) and seen[1] == Counter(range(7))
    assert units.epochs == 2.0


def test_a_dead_replicas_unit_goes_to_another_in_the_same_epoch_and_its_late_report_is_ignored():
    units = Units(3, seed=0, lease=5.0)
    dead = units.hand_out(worker=1, now=0.0)
    alive = [units.hand_out(worker=2, now=0.0) for _ in range(2)]
    units.renew(2, now=4.0)
    units.expire(now=6.0)                      # worker 1 silent for its lease; worker 2 renewed
    assert units.held_by(1) == [] and sorted(units.held_by(2)) == sorted(alive)
    again = units.hand_out(worker=2, now=6.0)
    assert again == dead                       # the same unit, the same epoch, before the next epoch
    assert not units.finish(1, *dead)          # the dead replica's late report counts for nothing
    for key in [*alive, again]:
        assert units.finish(2, *key)
    assert units.epochs == 1.0 and units.taken_back == 1 and units.ignored == 1


def test_the_position_resumes_the_epoch_without_its_finished_units():
    units = Units(5, seed=3, lease=5.0)
    for _ in range(6):                          # one epoch and one unit of the next
        key = units.hand_out(worker=1, now=0.0)
        units.finish(1, *key)
    finished = key
    held = units.hand_out(worker=1, now=0.0)    # out, not finished: handed out again after resuming
    resumed = Units(5, seed=3, lease=5.0)
    resumed.restore(units.position())
    rest = [resumed.hand_out(worker=9, now=0.0) for _ in range(4)]
    assert resumed.epoch == 1 and finished not in rest and held in rest
    assert {u for _, u in rest} == set(range(5)) - {finished[1]}
    assert resumed.epochs == pytest.approx(6 / 5)


def test_the_shuffle_buffer_hands_out_each_example_once():
    buffer = ShuffleBuffer(1, np.random.default_rng(0), capacity=4)
    for tag in range(3):
        rows = np.arange(tag * 10, tag * 10 + 10, dtype=np.float32)[:, None]
        buffer.add(rows, rows[:, 0].astype(np.int64), tag)
    drawn = [buffer.take(7) for _ in range(5)]
    values = np.concatenate([x[:, 0] for x, _, _, _ in drawn]).astype(int)
    assert sorted(values.tolist()) == list(range(30)) and buffer.size == 0
    assert all(np.array_equal(x[:, 0].astype(int), y) and np.array_equal(t, y // 10) for x, y, _, t in drawn)
    assert values[:10].tolist() != list(range(10))  # shuffled, not in file order


# --- replicas streaming from a dispenser on a real socket -------------------------------------

def write_parts(folder, files=4, per_file=60, group=20, ids=False):
    """Rows numbered 0.. in files of row groups, the last file held out; with ids, an id
    column `item` (the row's number * 7) that the file set reads for embeddings."""
    folder.mkdir()
    for k in range(files):
        index = np.arange(k * per_file, (k + 1) * per_file)
        columns = {"row": index.astype(np.float64), "y": index % 2, **({"item": index * 7} if ids else {})}
        pq.write_table(pa.table(columns), folder / f"p{k}.parquet", row_group_size=group)
    return FileSet(jobspec.Data(source=f"parquet:{folder}/*.parquet", test=f"{folder}/p{files - 1}.parquet",
                                ids=("item",) if ids else ()))


def start_dispenser(file_set: FileSet, stop: threading.Event, **settings) -> Dispenser:
    return Dispenser(DispenserSettings(bind="tcp://127.0.0.1:0", units=len(file_set.train_units), seed=0,
                                       layout=LAYOUT, **settings), stop=stop).start()


def stream(file_set: FileSet, address: str, worker: int, stop: threading.Event, batch: int = 16,
           with_ids: bool = False) -> StreamedBatches:
    link = ops.DispenserLink(address, worker_id=worker, layout=LAYOUT, security=None, stop=stop)
    return StreamedBatches(file_set, link, batch, np.random.default_rng(worker), stop=stop, buffer_examples=50,
                           with_ids=with_ids)


@pytest.mark.parametrize("with_ids", [False, True], ids=["dense", "with-ids"])
def test_two_replicas_see_every_example_once_per_epoch(tmp_path, with_ids):
    file_set = write_parts(tmp_path / "d", ids=with_ids)   # 3 training files x 3 row groups = 9 units, 180 examples
    stop = threading.Event()
    dispenser = start_dispenser(file_set, stop)
    per_epoch: dict[int, Counter] = {0: Counter(), 1: Counter()}
    by_replica: dict[int, int] = {1: 0, 2: 0}
    shapes: set[int] = set()       # the id columns each minibatch carried
    wrong_ids: list[int] = []      # ids that came with another row than their own
    lock = threading.Lock()

    def replica(worker: int) -> None:
        batches = stream(file_set, dispenser.endpoint, worker, stop, with_ids=with_ids)
        while not stop.is_set():
            try:
                x, _, ids, epochs = batches.next_batch()
            except errors.Stopped:
                return
            with lock:
                shapes.add(ids.shape[1])
                if with_ids:
                    wrong_ids.extend(ids[ids[:, 0] != x[:, 0].astype(np.int64) * 7, 0])   # each row's own id
                for row, epoch in zip(x[:, 0].astype(int), epochs):
                    per_epoch.setdefault(int(epoch), Counter())[int(row)] += 1
                by_replica[worker] += len(x)
                if sum(per_epoch[1].values()) >= 180 and sum(per_epoch[0].values()) >= 180:
                    stop.set()

    threads = [threading.Thread(target=replica, args=(w,)) for w in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    stop.set()
    dispenser.stop()
    assert per_epoch[0] == Counter(range(180)) and per_epoch[1] == Counter(range(180))
    assert by_replica[1] > 0 and by_replica[2] > 0     # both took a share
    assert shapes == {1 if with_ids else 0} and wrong_ids == []
    assert dispenser.units.epochs > 1 and dispenser.failure is None  # the last reports may still be on the way


def test_a_unit_of_a_replica_that_stopped_asking_is_streamed_by_another(tmp_path):
    file_set = write_parts(tmp_path / "d", files=3, per_file=40, group=40)   # 2 units of 40
    stop = threading.Event()
    dispenser = start_dispenser(file_set, stop, lease=0.5)
    silent = ops.DispenserLink(dispenser.endpoint, worker_id=7, layout=LAYOUT, security=None, stop=stop)
    status, taken = silent.ask(ops.UnitAsk())   # a replica that takes a unit and dies
    assert status == Status.OK and taken.epoch == 0
    batches = stream(file_set, dispenser.endpoint, 8, stop, batch=10)
    rows: Counter = Counter()
    while sum(rows.values()) < 80:
        x, _, _, epochs = batches.next_batch()
        rows.update(int(r) for r, e in zip(x[:, 0], epochs) if e == 0)
    stop.set()
    dispenser.stop()
    assert rows == Counter(range(80))            # the dead replica's unit too, once, in epoch 0
    assert dispenser.units.taken_back == 1


def test_a_bad_unit_ends_the_stream_naming_it_or_is_skipped(tmp_path):
    file_set = write_parts(tmp_path / "d", files=3, per_file=20, group=20)
    (tmp_path / "d" / "p1.parquet").write_bytes(b"PAR1 not really")
    for skip in (False, True):
        stop = threading.Event()
        dispenser = start_dispenser(file_set, stop)
        link = ops.DispenserLink(dispenser.endpoint, worker_id=3, layout=LAYOUT, security=None, stop=stop)
        batches = StreamedBatches(file_set, link, 5, np.random.default_rng(0), stop=stop, skip_bad=skip)
        if skip:
            rows = {int(r) for _ in range(12) for r in next(batches)[0][:, 0]}
            assert rows == set(range(20))        # only p0's rows: p1 was skipped, epoch after epoch
        else:
            with pytest.raises(errors.BadData, match=r"p1.parquet.*cannot be read"):
                for _ in range(10):
                    next(batches)
        stop.set()
        dispenser.stop()


def test_a_streamed_job_opens_the_coordinator_port_beside_shard_0_for_its_dispenser():
    from distbelief.operator.render import render
    from distbelief.operator.validation.job import DistBeliefJob
    from distbelief.runtime import contract

    from support.examples import load_example

    def ports(doc):
        objects = render.render_children(DistBeliefJob.validated(doc), image="distbelief:test")
        sts = next(o for o in objects if o["kind"] == "StatefulSet")
        return {p["name"] for p in sts["spec"]["template"]["spec"]["containers"][0]["ports"]}

    doc = load_example("digits-mlp.yaml")
    assert contract.COORDINATOR_PORT_NAME not in ports(doc)
    doc["spec"]["data"] = {"source": "parquet:/data/train/*.parquet", "volume": "training-data"}
    assert contract.COORDINATOR_PORT_NAME in ports(doc)
    doc["spec"]["training"]["algorithm"] = "sandblaster"   # loads the files whole: the coordinator's port
    assert contract.COORDINATOR_PORT_NAME in ports(doc)
    sparse = load_example("ctr-sparse.yaml")                # loads synthetic-ctr: data whole
    assert contract.COORDINATOR_PORT_NAME not in ports(sparse)
    sparse["spec"]["data"] = {"source": "parquet:/data/clicks/*.parquet", "ids": ["c0", "c1"], "volume": "clicks"}
    assert contract.COORDINATOR_PORT_NAME in ports(sparse)   # its replicas stream the files


def test_a_restarted_dispenser_resumes_the_epoch_from_its_recorded_position(tmp_path):
    settings = DispenserSettings(bind="tcp://127.0.0.1:0", units=6, seed=4, layout=LAYOUT, position_dir=str(tmp_path))
    first = Dispenser(settings, stop=threading.Event())
    done = []
    for _ in range(4):   # four units of epoch 0 finished, then the shard's process dies
        status, given = first.answer(1, ops.UnitAsk())
        first.answer(1, ops.UnitAsk(finished=given.unit, epoch=given.epoch, want=0))
        done.append(given.unit)
    first.record()
    again = Dispenser(settings, stop=threading.Event())
    rest = [again.answer(2, ops.UnitAsk())[1] for _ in range(2)]
    assert {g.unit for g in rest} == set(range(6)) - set(done) and {g.epoch for g in rest} == {0}
    assert again.units.epochs == pytest.approx(4 / 6)
    assert again.answer(2, ops.UnitAsk())[1].epoch == 1   # and then the next epoch
    (tmp_path / "data-position.json").write_text('{"epoch": 3, "units": 99}')
    assert Dispenser(settings, stop=threading.Event()).units.epoch == 0  # another file set's: ignored
