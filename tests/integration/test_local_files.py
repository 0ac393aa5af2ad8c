"""Local mode on a file source: replicas stream only the Parquet row groups the chief hands
them, train to 95% held-out accuracy (a softmax on a linear teacher's labels), and the epochs
show in report.json and history.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from distbelief.operator.validation.job import DistBeliefJob
from distbelief.runtime import contract, errors
from distbelief.runtime.model import models
from support.localruns import run_job
from support.filejobs import job, sparse_job, write_ctr_parquet, write_teacher_parquet

pytestmark = pytest.mark.slow

def test_replicas_stream_parquet_row_groups_to_the_target_accuracy(tmp_path: Path) -> None:
    write_teacher_parquet(tmp_path / "train", files=5, per_file=300, group=100)   # 1,200 to train on
    code, summary = run_job(job(f"parquet:{tmp_path}/train/*.parquet", testFraction=0.2), tmp_path / "out")
    assert code == 0 and summary["phase"] == "Succeeded", summary["reason"]
    assert summary["reason"] == "TargetAccuracyReached" and summary["accuracy"] >= 0.95
    assert summary["epoch"] >= 1   # more than one pass over the files, one unit at a time
    [history] = (tmp_path / "out" / "volumes").glob(f"files-ps-0/{contract.CHECKPOINT_VOLUME}/{contract.HISTORY_FILE}")
    epochs = [json.loads(line)["epoch"] for line in history.read_text().splitlines()]
    assert epochs == sorted(epochs) and epochs[-1] > 0
    logs = (tmp_path / "out" / "logs")
    assert "event=dispenser_listening" in (logs / "files-ps-0.log").read_text()


def test_a_corrupt_parquet_file_fails_the_job_as_invalid_config_naming_it(tmp_path: Path) -> None:
    write_teacher_parquet(tmp_path / "train", files=3, per_file=300, group=100)
    (tmp_path / "train" / "part-01.parquet").write_bytes(b"PAR1 this is not parquet")
    code, summary = run_job(job(f"parquet:{tmp_path}/train/*.parquet", test=f"{tmp_path}/train/part-02.parquet"),
                            tmp_path / "out")
    assert code == 1 and summary["phase"] == "Failed"
    assert summary["reason"].startswith("InvalidConfig") and "part-01.parquet" in summary["reason"]
    assert summary["restarts"] == 0


def test_with_on_bad_file_skip_the_corrupt_file_is_left_out_and_the_job_trains(tmp_path: Path) -> None:
    write_teacher_parquet(tmp_path / "train", files=4, per_file=300, group=100)
    (tmp_path / "train" / "part-01.parquet").write_bytes(b"PAR1 this is not parquet")
    doc = job(f"parquet:{tmp_path}/train/*.parquet", test=f"{tmp_path}/train/part-03.parquet", onBadFile="skip")
    doc["spec"]["training"]["targetAccuracy"] = 0.9
    code, summary = run_job(doc, tmp_path / "out")
    assert code == 0 and summary["reason"] == "TargetAccuracyReached", summary["reason"]
    assert "part-01.parquet" in (tmp_path / "out" / "logs" / "files-ps-0.log").read_text()  # said so


def test_a_partitioned_replica_streams_into_partition_0_only(tmp_path: Path) -> None:
    write_teacher_parquet(tmp_path / "train", files=5, per_file=120, group=40)  # an epoch well before 0.9
    doc = job(f"parquet:{tmp_path}/train/*.parquet")
    doc["spec"]["model"] = {"type": "mlp", "hiddenLayers": [16], "partitions": 2}
    doc["spec"]["parameterServers"]["shards"] = 2
    doc["spec"]["workers"]["replicas"] = 1
    doc["spec"]["training"]["targetAccuracy"] = 0.9
    code, summary = run_job(doc, tmp_path / "out")
    assert code == 0 and summary["reason"] == "TargetAccuracyReached", summary["reason"]
    assert summary["epoch"] > 0
    logs = tmp_path / "out" / "logs"
    assert "event=rendezvous_listening" in (logs / "files-ps-0.log").read_text()
    assert "event=dispenser_listening" not in (logs / "files-ps-0.log").read_text()  # one port: the rendezvous's


def test_preflight_counts_the_files_rows_and_checks_the_held_out_part_without_the_training_files(tmp_path: Path):
    from distbelief.operator.local import preflight

    write_teacher_parquet(tmp_path / "train", files=4, per_file=300, group=100)
    checked = preflight.check(DistBeliefJob.validated(job(f"parquet:{tmp_path}/train/*.parquet")))
    assert (checked.examples, checked.features, checked.classes) == (1200, 8, 3)
    held_out = sorted((tmp_path / "train").glob("*.parquet"))[-1]
    doc = job(f"parquet:{tmp_path}/train/*.parquet", test=str(held_out))
    table = pq.read_table(held_out).to_pydict()
    table["f3"][5] = float("nan")
    pq.write_table(pa.table(table), held_out, row_group_size=100)
    with pytest.raises(errors.BadData, match=r"part-03.parquet row group 0: column 'f3' row 5"):
        preflight.check(DistBeliefJob.validated(doc))


def units_read(log: str) -> list[tuple[int, int]]:
    """(epoch, unit) of each unit a replica read, from its event=unit_read lines."""
    return [(int(line.split("epoch=")[1].split()[0]), int(line.split(" unit=")[1].split()[0]))
            for line in log.splitlines() if "event=unit_read" in line]


def test_replicas_of_a_job_with_embeddings_stream_their_units_with_the_ids(tmp_path: Path) -> None:
    logits = write_ctr_parquet(tmp_path / "train", files=8, per_file=2000, group=500)
    held_out = f"{tmp_path}/train/part-0[67].parquet"            # 4,000 rows; 24 units of 500 to train on
    doc = sparse_job(f"parquet:{tmp_path}/train/*.parquet", test=held_out)
    code, summary = run_job(doc, tmp_path / "out")
    assert code == 0 and summary["phase"] == "Succeeded", summary["reason"]
    planted = models.auc(logits[12000:], np.concatenate([pq.read_table(p)["y"].to_numpy()
                                                         for p in sorted((tmp_path / "train").glob("part-0[67]*"))]))
    print(f"held-out AUC {summary['auc']:.4f}, the planted model's {planted:.4f}, epochs {summary['epoch']}")
    assert summary["auc"] >= 0.7 and summary["auc"] >= planted - 0.08
    logs = tmp_path / "out" / "logs"
    assert "event=dispenser_listening" in (logs / "files-ps-0.log").read_text()
    replicas = [units_read(path.read_text()) for path in sorted(logs.glob("files-worker-*.log"))]
    assert len(replicas) == 2 and all(replicas)            # both replicas streamed, a share each
    complete = int(summary["epoch"])
    assert complete >= 2
    for epoch in range(complete):                          # every training unit once per epoch, by one replica
        shares = [{u for e, u in read if e == epoch} for read in replicas]
        assert sorted(u for share in shares for u in share) == list(range(24)), epoch
    history = (tmp_path / "out" / "volumes" / f"files-ps-0/{contract.CHECKPOINT_VOLUME}/{contract.HISTORY_FILE}")
    epochs = [json.loads(line)["epoch"] for line in history.read_text().splitlines()]
    assert epochs == sorted(epochs) and complete <= epochs[-1] <= summary["epoch"]
