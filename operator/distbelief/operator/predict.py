"""`distbelief predict`: use the parameters a finished local run left in its output folder.

    trained = load("job.yaml", output="out/digits")
    trained.evaluate()          # (loss, accuracy) on the job's held-out split
    trained.predict(raw_x)      # labels; training's preprocessing is applied to raw_x

The model, the data split and the preprocessing are rebuilt from the job by the roles'
own derivation (model.job.Job), so the figures match what the chief reported. A model with
embeddings is refused: its rows live in the shards' checkpoints, not in params.npz.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from distbelief.operator.local.localpods import volume_dir
from distbelief.operator.validation import spec
from distbelief.runtime import contract, errors, jobspec
from distbelief.runtime.model import data, models
from distbelief.runtime.model.job import Job


@dataclasses.dataclass(frozen=True)
class Trained:
    spec: jobspec.JobSpec
    model: models.Model
    params: np.ndarray
    dataset: data.Dataset

    def evaluate(self) -> tuple[float, float]:
        """Held-out (loss, accuracy), as the chief scores it."""
        return models.evaluate(self.model, self.params, self.dataset.x_test, self.dataset.y_test)

    def predict(self, raw_x: np.ndarray) -> np.ndarray:
        """Labels for raw features, preprocessed as the job's training data was."""
        x = data.preprocess(self.spec.data.source, np.asarray(raw_x, dtype=np.float32))
        return self.model.predict(self.params, np.ascontiguousarray(x, dtype=np.float32))


def load(path: str, *, output: str | None = None, best: bool = False) -> Trained:
    """The trained model of the job in path, from params.npz in its output folder (best:
    params-best.npz, the parameters of its best held-out evaluation)."""
    config = spec.job_config(spec.validate_job(spec.load_single(path, "distbelief predict")))
    output = output or os.path.join("out", config.name)
    if config.spec.model.embeddings is not None:
        raise errors.ConfigError(f"{path}: distbelief predict does not serve a model with spec.model.embeddings yet "
                                 "(its rows are in the shards' checkpoints, not in params.npz)")
    derived = Job(config)
    return Trained(spec=derived.spec, model=derived.model,
                   params=_read_params(_params_file(config.names, output, best), derived.model), dataset=derived.dataset)


def _params_file(names: contract.JobNames, output: str, best: bool = False) -> str:
    name = contract.BEST_PARAMS_FILE if best else contract.PARAMS_FILE
    chief = volume_dir(output, names.shard_pod(0), contract.CHECKPOINT_VOLUME)
    for folder in (output, chief):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            return path
    if best:
        raise errors.ConfigError(f"{output}: no {name}; a run saves it with spec.training.keepBest: true")
    raise errors.ConfigError(f"{output}: no {name}; a run writes it when the job finishes "
                             "(distbelief run JOB.yaml, or --output DIR for another folder)")


def _read_params(path: str, model: models.Model) -> np.ndarray:
    """The flat parameter vector from params.npz's named arrays, in the model's order."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as exc:
        raise errors.ConfigError(f"{path}: cannot read: {exc}") from exc
    wanted = {name: tuple(shape) for name, shape in model.shapes}
    found = {name: array.shape for name, array in arrays.items()}
    if found != wanted:
        raise errors.ConfigError(f"{path}: holds the parameters of another model ({found}; this job's: {wanted})")
    return np.concatenate([arrays[name].ravel() for name in wanted]).astype(np.float32)


def predict_source(trained: Trained, source: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Predicted labels for a data source (its features preprocessed as in training), and its
    labels when it has them."""
    x, y = data.load_inputs(source, trained_on=trained.spec.data.source, columns=trained.spec.data)
    if x.shape[1] != trained.dataset.n_features:
        raise errors.ConfigError(f"{source}: x has {x.shape[1]} features, the model takes {trained.dataset.n_features}")
    return trained.model.predict(trained.params, x), y


def write_predictions(path: str, labels: np.ndarray) -> None:
    """An npz with array `y`, or else a text file of one label per line."""
    if path.endswith(".npz"):
        np.savez(path, y=labels)
    else:
        np.savetxt(path, labels, fmt="%d")
