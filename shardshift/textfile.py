"""Reading a file a user named: every way it can fail to be the text asked for, said in one line.

Each reader takes the flag that named the file (``--topology``; None where the file is named by
its place on the command line) and what the file should be (``"a YAML topology file
(docs/topology.md)"``), and raises `FileError` reading ``FLAG PATH: what is wrong; what to do``:

    --topology lab.yaml: not UTF-8 text (byte 8 is 0xec); give a YAML topology file (docs/topology.md),
    converted to UTF-8 if it is in another encoding

A missing file, a directory, a file that cannot be read, an empty one, bytes that are not UTF-8,
NUL bytes (which no text holds, and which mark a binary file that happens to decode), and YAML
or JSON that does not parse are told apart. What the parsed content must hold is the caller's to
check.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class FileError(ValueError):
    """A file that cannot be read as the text asked for. ``str()`` is the whole line; `problem`
    is what is wrong alone ("not UTF-8 text (byte 8 is 0xec)"), for a caller that names the
    file its own way."""

    def __init__(self, flag: str | None, path: str | os.PathLike, problem: str, fix: str) -> None:
        super().__init__(f"{naming(flag, path)}: {problem}; {fix}")
        self.problem = problem


def naming(flag: str | None, path: str | os.PathLike) -> str:
    """How messages name file `path` given by `flag`: ``--topology lab.yaml`` (or the path alone)."""
    return str(path) if flag is None else f"{flag} {path}"


def read_bytes(path: str | os.PathLike, flag: str | None, wanted: str) -> bytes:
    """The bytes of file `path`; `FileError` if it is missing, a directory or unreadable."""
    file = Path(path)
    if file.is_dir():
        raise FileError(flag, path, "a directory", f"give the path of {wanted}")
    if not file.exists():
        raise FileError(flag, path, "no such file", f"give the path of {wanted}")
    try:
        return file.read_bytes()
    except OSError as err:
        fix = "check its permissions" if isinstance(err, PermissionError) else f"give {wanted}"
        raise FileError(flag, path, f"cannot be read ({err.strerror or err})", fix) from None


def decode_text(raw: bytes, path: str | os.PathLike, flag: str | None, wanted: str) -> str:
    """`raw`, the content of `path`, as text; `FileError` if it is empty, not UTF-8 or holds NUL bytes."""
    if not raw:
        raise FileError(flag, path, "the file is empty", f"give {wanted}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise FileError(flag, path, f"not UTF-8 text (byte {err.start} is {raw[err.start]:#04x})",
                        f"give {wanted}, converted to UTF-8 if it is in another encoding") from None
    if "\x00" in text:
        raise FileError(flag, path, "it holds NUL bytes, which text does not", f"give {wanted}")
    return text


def read_text(path: str | os.PathLike, flag: str | None, wanted: str) -> str:
    """The text of file `path` (UTF-8, not empty); `FileError` saying why not."""
    return decode_text(read_bytes(path, flag, wanted), path, flag, wanted)


def read_yaml(path: str | os.PathLike, flag: str | None, wanted: str):
    """The parsed content of YAML file `path`; `FileError` if it is not text or not YAML."""
    import yaml

    text = read_text(path, flag, wanted)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise FileError(flag, path, f"not valid YAML ({_one_line(getattr(err, 'problem', None) or err)}{where})",
                        f"give {wanted}") from None


def read_json(path: str | os.PathLike, flag: str | None, wanted: str):
    """The parsed content of JSON file `path`; `FileError` if it is not text or not JSON."""
    text = read_text(path, flag, wanted)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise FileError(flag, path, f"not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})",
                        f"give {wanted}") from None


def _one_line(message) -> str:
    """A parser's message, which may run over lines, in one."""
    return " ".join(str(message).split())
