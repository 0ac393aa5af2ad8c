"""A job's keys folder on disk: the file names, and reading and writing them privately.

The folder is a mounted Secret on a cluster and OUTPUT/keys in local mode; each file holds
the 40-character Z85 text of one 32-byte key and a newline, mode 0600. distbelief.runtime.keys
gives the files their meaning; this module only keeps them from other users' reach.
"""

from __future__ import annotations

import os
import stat

from distbelief.runtime import errors

SERVER_PUBLIC = "server.public"
SERVER_SECRET = "server.secret"
CLIENT_PUBLIC = "client.public"
CLIENT_SECRET = "client.secret"
CHIEF_PUBLIC = "chief.public"
CHIEF_SECRET = "chief.secret"
STAGE_PUBLIC = "stage.public"
STAGE_SECRET = "stage.secret"
FILES = (SERVER_PUBLIC, SERVER_SECRET, CLIENT_PUBLIC, CLIENT_SECRET, CHIEF_PUBLIC, CHIEF_SECRET,
         STAGE_PUBLIC, STAGE_SECRET)
# What a replica needs: it never serves nor ends the job, so it holds neither the
# server's nor the chief's secret.
CLIENT_FILES = (SERVER_PUBLIC, CLIENT_PUBLIC, CLIENT_SECRET)
# What a partitioned job's replica adds: each of its pods serves its stage to the others.
STAGE_FILES = (STAGE_PUBLIC, STAGE_SECRET)
REQUIRED_FILES = (SERVER_PUBLIC, CLIENT_PUBLIC)  # in every role's copy
# Keypairs an earlier version's folder may lack, which ensure() then adds (name prefixes).
ADDED_PAIRS = ("chief", "stage")
Z85_KEY_LENGTH = 40
FILE_MODE = 0o600
FOLDER_MODE = 0o700


def write_files(folder: str, files: dict[str, str]) -> None:
    """Write key files into folder (made 0700), each 0600; never overwrites a file, nor
    follows a link planted where one should be."""
    try:
        os.makedirs(folder, mode=FOLDER_MODE, exist_ok=True)
        os.chmod(folder, FOLDER_MODE)
        for name, text in files.items():
            fd = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(text)
    except OSError as exc:
        raise errors.ConfigError(f"cannot write job keys into {folder}: {exc.strerror or exc}") from exc


def read_texts(folder: str) -> dict[str, bytes]:
    """File name -> its key text, for each key file present in folder."""
    texts: dict[str, bytes] = {}
    for name in FILES:
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as f:
                texts[name] = f.read(4 * Z85_KEY_LENGTH).strip()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise errors.ConfigError(f"cannot read job key {path}: {exc.strerror or exc}") from exc
    return texts


def check_private(folder: str) -> None:
    """Refuse a keys folder (or a key file in it) that is a link, not the user's, or open to others."""
    for path in [folder, *(os.path.join(folder, name) for name in FILES)]:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(info.st_mode):
            raise errors.ConfigError(f"keys: {path} is a symbolic link; refusing to use it")
        if info.st_uid != os.getuid():
            raise errors.ConfigError(f"keys: {path} belongs to uid {info.st_uid}, not to this user")
        if info.st_mode & 0o077:
            raise errors.ConfigError(f"keys: {path} is open to other users (mode {info.st_mode & 0o777:o}); "
                                     f"chmod go-rwx it, or start afresh with --fresh")
