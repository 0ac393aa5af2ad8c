"""File sources (model/files.py, model/readers.py): Parquet, CSV, npz and npy globs read by
column, the held-out files, and one error naming the file, column and row group for bad input."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from distbelief.runtime import errors, jobspec
from distbelief.runtime.model import data, files

FEATURES = 3


def rows(start: int, n: int) -> dict[str, np.ndarray]:
    """Rows numbered start..start+n-1: feature a is the row's number, the label its parity."""
    index = np.arange(start, start + n)
    return {"a": index.astype(np.float64), "b": np.ones(n), "c": -np.ones(n, np.float32), "y": index % 3,
            "note": np.array([f"row{i}" for i in index])}


def write_parquet(folder: Path, files_: int = 4, per_file: int = 30, group: int = 10) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(files_):
        pq.write_table(pa.table(rows(k * per_file, per_file)), folder / f"part-{k}.parquet", row_group_size=group)
    return folder


def write_csv(folder: Path, files_: int = 3, per_file: int = 20, gz: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(files_):
        table = rows(k * per_file, per_file)
        lines = ["a,b,c,y,note"] + [f"{a},{b},{c},{y},{n}" for a, b, c, y, n in zip(*table.values())]
        text = "\n".join(lines) + "\n"
        if gz:
            (folder / f"part-{k}.csv.gz").write_bytes(gzip.compress(text.encode()))
        else:
            (folder / f"part-{k}.csv").write_text(text)
    return folder


def spec(source: str, **fields) -> jobspec.Data:
    return jobspec.Data(source=source, **fields)


def seen(x: np.ndarray) -> set[int]:
    return set(x[:, 0].astype(int).tolist())


def test_parquet_glob_is_read_row_group_by_row_group_with_whole_files_held_out(tmp_path):
    folder = write_parquet(tmp_path / "train")
    file_set = files.FileSet(spec(f"parquet:{folder}/*.parquet", test_fraction=0.25))
    assert len(file_set.train_files) == 3 and len(file_set.test_files) == 1
    assert len(file_set.train_units) == 9 and all(u.group >= 0 and u.rows == 10 for u in file_set.train_units)
    assert file_set.columns.features == ("a", "b", "c")  # the string column is not a feature
    ds = data.load(file_set.spec)
    assert ds.n_features == FEATURES and ds.n_classes == 3 and ds.x_train.dtype == np.float32
    held = int(file_set.test_files[0].split("-")[-1].split(".")[0])
    assert seen(ds.x_test) == set(range(held * 30, held * 30 + 30))
    assert seen(ds.x_train) | seen(ds.x_test) == set(range(120)) and not seen(ds.x_train) & seen(ds.x_test)
    np.testing.assert_array_equal(ds.y_train, ds.x_train[:, 0].astype(int) % 3)


def test_named_test_files_labels_and_features(tmp_path):
    folder = write_parquet(tmp_path / "d", files_=3)
    ds = data.load(spec(f"parquet:{folder}/*.parquet", test=f"{folder}/part-2.parquet", features=["a", "c"]))
    assert ds.n_features == 2 and seen(ds.x_test) == set(range(60, 90)) and len(ds.x_train) == 60
    relabelled = data.load(spec(f"parquet:{folder}/*.parquet", test=f"{folder}/part-2.parquet", label="b",
                                features=["a", "y"]))
    assert relabelled.n_classes == 2 and set(relabelled.y_train.tolist()) == {1}


def test_csv_gz_npz_and_npy_globs_read_the_same_examples(tmp_path):
    csv = data.load(spec(f"csv:{write_csv(tmp_path / 'csv')}/*.csv.gz", test_fraction=0.3))
    plain = data.load(spec(f"csv:{write_csv(tmp_path / 'plain', gz=False)}/*.csv", test_fraction=0.3))
    assert csv.n_features == FEATURES and seen(csv.x_train) | seen(csv.x_test) == set(range(60))
    np.testing.assert_array_equal(csv.x_train, plain.x_train)
    for k in range(3):
        table = rows(k * 20, 20)
        np.savez(tmp_path / f"n-{k}.npz", x=np.column_stack([table["a"], table["b"]]), y=table["y"])
        structured = np.zeros(20, dtype=[("a", "f8"), ("b", "f4"), ("y", "i8")])
        structured["a"], structured["b"], structured["y"] = table["a"], table["b"], table["y"]
        np.save(tmp_path / f"s-{k}.npy", structured)
    npz = data.load(spec(f"npz:{tmp_path}/n-*.npz", test_fraction=0.3))
    npy = data.load(spec(f"npy:{tmp_path}/s-*.npy", test_fraction=0.3))
    for ds in (npz, npy):
        assert ds.n_features == 2 and seen(ds.x_train) | seen(ds.x_test) == set(range(60))
        assert len(ds.x_test) == 20  # one whole file of three


def test_ids_columns_feed_embeddings(tmp_path):
    folder = tmp_path / "ids"
    folder.mkdir()
    for k in range(2):
        table = rows(k * 10, 10)
        pq.write_table(pa.table({"user": np.arange(10) + k, "item": np.arange(10) * 2, "y": table["y"] % 2,
                                 "a": table["a"]}), folder / f"{k}.parquet")
    ds = data.load(spec(f"parquet:{folder}/*.parquet", ids=["user", "item"], test_fraction=0.5))
    assert ds.fields == 2 and ds.n_features == 1 and ds.ids_train.dtype == np.int64


def test_the_existing_single_npz_source_is_unchanged(tmp_path):
    x = np.arange(100, dtype=np.float32)[:, None]
    np.savez(tmp_path / "one.npz", x=x, y=np.arange(100) % 2)
    assert not files.is_file_set(f"npz:{tmp_path}/one.npz")
    ds = data.load(spec(f"npz:{tmp_path}/one.npz"))
    assert len(ds.x_test) == 20 and len(ds.x_train) == 80  # examples split, not files


def test_one_file_without_named_test_files_says_what_to_do(tmp_path):
    write_parquet(tmp_path / "one", files_=1)
    with pytest.raises(errors.ConfigError, match="single file.*spec.data.test"):
        files.FileSet(spec(f"parquet:{tmp_path}/one/*.parquet"))


def test_a_missing_column_names_the_file_and_its_columns(tmp_path):
    folder = write_parquet(tmp_path / "d")
    with pytest.raises(errors.ConfigError, match=r"spec.data.features: .*part-0.parquet has no column 'z'"):
        files.FileSet(spec(f"parquet:{folder}/*.parquet", features=["a", "z"]))


# --- bad input: one error naming the file, the column and the row group -----------------------

def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(errors.BadData, match=r"gone.parquet: no such file"):
        files.FileSet(spec(f"parquet:{tmp_path}/gone.parquet", test=f"{tmp_path}/held-out.parquet"))
    with pytest.raises(errors.ConfigError, match=r"no file matches .*/nothing-\*.csv"):
        files.FileSet(spec(f"csv:{tmp_path}/nothing-*.csv"))


def test_a_corrupt_parquet_file_is_named_and_skipped_with_on_bad_file_skip(tmp_path):
    folder = write_parquet(tmp_path / "d")
    (folder / "part-1.parquet").write_bytes(b"PAR1 garbage, not a footer")
    source = f"parquet:{folder}/*.parquet"
    with pytest.raises(errors.BadData, match=r"part-1.parquet: cannot be read"):
        files.FileSet(spec(source, test=f"{folder}/part-3.parquet"))
    skipping = files.FileSet(spec(source, test=f"{folder}/part-3.parquet", on_bad_file="skip"))
    assert {u.file for u in skipping.train_units} == {f"{folder}/part-0.parquet", f"{folder}/part-2.parquet"}
    assert len(skipping.skipped) == 1 and "part-1.parquet" in skipping.skipped[0]


def test_a_file_whose_columns_differ_is_named_with_both_column_lists(tmp_path):
    folder = write_parquet(tmp_path / "d")
    table = rows(0, 5)
    table["extra"] = np.zeros(5)
    pq.write_table(pa.table(table), folder / "part-9.parquet")
    with pytest.raises(errors.BadData, match=r"part-9.parquet: its columns \[.*'extra'\] differ from .*part-0.parquet's"):
        files.FileSet(spec(f"parquet:{folder}/*.parquet", test=f"{folder}/part-3.parquet"))


def test_a_nan_feature_names_the_file_column_row_and_row_group(tmp_path):
    folder = write_parquet(tmp_path / "d")
    table = rows(60, 30)
    table["b"][17] = np.nan   # row group 1 (rows 10..19), its row 7
    pq.write_table(pa.table(table), folder / "part-2.parquet", row_group_size=10)
    file_set = files.FileSet(spec(f"parquet:{folder}/*.parquet", test=f"{folder}/part-3.parquet"))
    bad = next(u for u in file_set.train_units if u.file.endswith("part-2.parquet") and u.group == 1)
    with pytest.raises(errors.BadData, match=r"part-2.parquet row group 1: column 'b' row 7: nan is not a finite"):
        file_set.read(bad)
    with pytest.raises(errors.BadData, match=r"part-2.parquet row group 1: column 'b'"):
        data.load(file_set.spec)


def test_a_label_outside_the_classes_is_named(tmp_path):
    folder = write_parquet(tmp_path / "d")
    held_out = rows(90, 30)
    held_out["y"][4] = 7        # the training labels make 3 classes
    pq.write_table(pa.table(held_out), folder / "part-3.parquet", row_group_size=10)
    with pytest.raises(errors.BadData, match=r"part-3.parquet row group 0: column 'y' row 4: label 7 is outside "
                                             r"the classes 0..2"):
        data.load(spec(f"parquet:{folder}/*.parquet", test=f"{folder}/part-3.parquet"))
    negative = rows(0, 20)
    negative["y"][3] = -1
    write_csv(tmp_path / "c", gz=False)
    lines = ["a,b,c,y,note"] + [f"{a},{b},{c},{y},{n}" for a, b, c, y, n in zip(*negative.values())]
    (tmp_path / "c" / "part-0.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(errors.BadData, match=r"c/part-0.csv: column 'y' row 3: label -1 is outside"):
        data.load(spec(f"csv:{tmp_path}/c/*.csv", test=f"{tmp_path}/c/part-2.csv"))
